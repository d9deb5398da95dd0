"""Which operations of each peer's OpenAPI document pipepool claims to serve, and where the
documents are kept (their sources and licenses: SOURCES.md beside this file).

A peer's claim is the operations (path, methods) of its own document that pipepool answers as
the peer does; the conformance suite (tests/test_conformance.py) runs schemathesis on exactly
these. ``BASE_PATHS``: the prefix the peer's ``servers`` entry puts before its paths.
"""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

# peer -> {path in the peer's document: methods pipepool serves}; RERANKER_PATHS: the paths a
# reranker answers (the others: an embedding model), each peer serving one model per server.
CLAIMED: dict[str, dict[str, tuple[str, ...]]] = {
    # TEI v1.9.3's docs/openapi.json (its router also serves POST /, absent from that document).
    "tei": {
        "/embed": ("POST",),
        "/embed_all": ("POST",),
        "/embed_sparse": ("POST",),
        "/rerank": ("POST",),
        "/predict": ("POST",),
        "/similarity": ("POST",),
        "/tokenize": ("POST",),
        "/decode": ("POST",),
        "/info": ("GET",),
        "/health": ("GET",),
        "/metrics": ("GET",),
        "/v1/embeddings": ("POST",),
    },
    # openai/openai-openapi's openapi.yaml, under its server https://api.openai.com/v1.
    "openai": {
        "/embeddings": ("POST",),
        "/models": ("GET",),
        "/files": ("POST", "GET"),
        "/files/{file_id}": ("GET", "DELETE"),
        "/files/{file_id}/content": ("GET",),
        "/batches": ("POST", "GET"),
        "/batches/{batch_id}": ("GET",),
        "/batches/{batch_id}/cancel": ("POST",),
    },
    # cohere-ai/cohere-developer-experience's cohere-openapi.yaml.
    "cohere": {
        "/v2/embed": ("POST",),
        "/v2/rerank": ("POST",),
        "/v1/embed": ("POST",),
        "/v1/tokenize": ("POST",),
        "/v1/detokenize": ("POST",),
    },
}
CLAIMED_PATHS = {peer: tuple(paths) for peer, paths in CLAIMED.items()}
RERANKER_PATHS = {"tei": ("/rerank", "/predict"), "openai": (), "cohere": ("/v2/rerank",)}
BASE_PATHS = {"tei": "", "openai": "/v1", "cohere": ""}
# The document's security scheme that carries the API key (TEI's document has none: the key
# goes in a header to every request).
AUTH_SCHEMES = {"tei": None, "openai": "ApiKeyAuth", "cohere": "bearerAuth"}


def claimed_for(peer: str, reranker: bool) -> dict[str, tuple[str, ...]]:
    """The claimed operations of ``peer`` that a reranker (or an embedding model) answers."""
    return {
        path: methods
        for path, methods in CLAIMED[peer].items()
        if (path in RERANKER_PATHS[peer]) == reranker
    }


SPEC_FILES = {"tei": "tei.json", "openai": "openai.json", "cohere": "cohere.json"}

# Where the documents are looked for, first found wins: $PIPEPOOL_CONFORMANCE_SPECS, the
# checkout's shared/ data folder, then beside this file.
_SPEC_DIRS = (
    os.environ.get("PIPEPOOL_CONFORMANCE_SPECS"),
    str(ROOT / "shared" / "conformance" / "specs"),
    str(HERE / "specs"),
)


def spec_path(peer: str, *, must_exist: bool = True) -> Path:
    """The trimmed document of ``peer`` (tests/conformance/extract_specs.py writes it)."""
    candidates = [Path(d) / SPEC_FILES[peer] for d in _SPEC_DIRS if d]
    if not must_exist:  # where extract_specs.py writes
        return Path(_SPEC_DIRS[0] or HERE / "specs") / SPEC_FILES[peer]
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"no {SPEC_FILES[peer]} in {', '.join(str(c.parent) for c in candidates)}: write it with "
        f"tests/conformance/extract_specs.py from the source SOURCES.md names"
    )
