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

# peer -> {path in the peer's document: methods pipepool serves}.
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
        "/models/{model}": ("GET",),
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
        "/v1/models": ("GET",),
        "/v1/models/{model}": ("GET",),
    },
}
CLAIMED_PATHS = {peer: tuple(paths) for peer, paths in CLAIMED.items()}
# Which server answers a path (one model each, as the peers' servers hold): "reranker" (a
# cross-encoder), "sparse" (a SPLADE model), else "embedder" (the bundled all-MiniLM-L6-v2).
SERVERS = ("embedder", "reranker", "sparse")
SERVED_BY = {
    "tei": {"/rerank": "reranker", "/predict": "reranker", "/embed_sparse": "sparse"},
    "openai": {},
    "cohere": {"/v2/rerank": "reranker"},
}
# Requests each operation is sent besides the generated ones (their "model" set to the served
# one): the peers' own documented examples, where the generator seldom makes a request that a
# real server of the peer would answer (Cohere's document requires no texts, so nearly every
# generated /v2/embed carries images; TEI's property examples are strings such as "true").
SEEDS: dict[tuple[str, str], tuple[dict, ...]] = {
    ("tei", "/embed"): ({"inputs": "What is Deep Learning?"},
                        {"inputs": ["What is Deep Learning?", "Deep Learning is ..."],
                         "normalize": True, "truncate": True}),
    ("tei", "/embed_sparse"): ({"inputs": "What is Deep Learning?"},),
    ("tei", "/rerank"): ({"query": "What is Deep Learning?", "texts": ["Deep Learning is ..."]},),
    ("tei", "/tokenize"): ({"inputs": "test"},),
    ("tei", "/v1/embeddings"): ({"input": "What is Deep Learning?", "model": ""},),
    ("openai", "/embeddings"): ({"input": "The food was delicious", "model": "",
                                 "encoding_format": "float"},),
    ("cohere", "/v2/embed"): ({"model": "", "texts": ["hello", "goodbye"],
                               "input_type": "classification", "embedding_types": ["float"]},),
    ("cohere", "/v1/embed"): ({"model": "", "texts": ["hello", "goodbye"],
                               "input_type": "classification"},),
    ("cohere", "/v1/tokenize"): ({"model": "", "text": "tokenize me! :D"},),
    ("cohere", "/v1/detokenize"): ({"model": "", "tokens": [10002, 2261, 2012, 8, 2792, 43]},),
    ("cohere", "/v2/rerank"): ({"model": "", "query": "What is the capital of France?",
                                "documents": ["Paris is the capital of France.", "Berlin."],
                                "top_n": 1},),
}  # fmt: skip
BASE_PATHS = {"tei": "", "openai": "/v1", "cohere": ""}
# The document's security scheme that carries the API key (TEI's document has none: the key
# goes in a header to every request).
AUTH_SCHEMES = {"tei": None, "openai": "ApiKeyAuth", "cohere": "bearerAuth"}


def claimed_for(peer: str, server: str) -> dict[str, tuple[str, ...]]:
    """The claimed operations of ``peer`` that ``server`` (one of SERVERS) answers."""
    return {
        path: methods
        for path, methods in CLAIMED[peer].items()
        if SERVED_BY[peer].get(path, "embedder") == server
    }


SPEC_FILES = {"tei": "tei.json", "openai": "openai.json", "cohere": "cohere.json"}

# Where the documents are looked for, first found wins: $PIPEPOOL_CONFORMANCE_SPECS, the
# project's shared/ data folder (inside the checkout, or beside it as on the CI machine), then
# beside this file (never committed: the documents are the peers', fetched as SOURCES.md says).
_SPEC_DIRS = (
    os.environ.get("PIPEPOOL_CONFORMANCE_SPECS"),
    str(ROOT / "shared" / "conformance" / "specs"),
    str(ROOT.parent / "shared" / "conformance" / "specs"),
    str(HERE / "specs"),
)


def specs_missing() -> list[str]:
    """The peers whose document is in none of the folders looked in."""
    return [
        peer
        for peer, name in SPEC_FILES.items()
        if not any((Path(d) / name).is_file() for d in _SPEC_DIRS if d)
    ]


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
