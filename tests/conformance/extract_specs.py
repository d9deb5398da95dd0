"""Write the peers' OpenAPI documents that the conformance suite reads, trimmed to the paths
pipepool claims (``peers.CLAIMED_PATHS``) and the components those paths reach.

Usage: ``python tests/conformance/extract_specs.py PEER SOURCE_FILE`` for each peer in
SOURCES.md (PEER: tei | openai | cohere; SOURCE_FILE: the peer's document at the commit
SOURCES.md names). The trimmed document is written, as JSON, where ``peers.spec_path`` reads
it. Only a document's own ``$ref`` graph is kept: nothing is rewritten, so every kept schema is
byte-for-byte the peer's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers


def _load(source: Path) -> dict:
    text = source.read_text(encoding="utf-8")
    if source.suffix == ".json":
        return json.loads(text)
    import yaml

    return yaml.safe_load(text)


def _refs(node, found: set[str]) -> None:
    """Every local ``$ref`` under ``node``."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/"):
            found.add(ref)
        for value in node.values():
            _refs(value, found)
    elif isinstance(node, list):
        for value in node:
            _refs(value, found)


def _resolve(document: dict, ref: str):
    node = document
    for part in ref[2:].split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def trim(document: dict, paths: tuple[str, ...]) -> dict:
    """``document`` with only ``paths`` and the components they reach (transitively)."""
    missing = [p for p in paths if p not in document.get("paths", {})]
    if missing:
        raise SystemExit(f"the document has no {', '.join(missing)}")
    kept_paths = {p: document["paths"][p] for p in paths}
    seen: set[str] = set()
    todo: set[str] = set()
    _refs(kept_paths, todo)
    while todo:
        ref = todo.pop()
        if ref in seen:
            continue
        seen.add(ref)
        _refs(_resolve(document, ref), todo)
    components: dict = {}
    for ref in sorted(seen):
        parts = ref[2:].split("/")
        if parts[0] != "components" or len(parts) != 3:
            raise SystemExit(f"unexpected reference {ref}")
        components.setdefault(parts[1], {})[parts[2]] = document["components"][parts[1]][parts[2]]
    schemes = document.get("components", {}).get("securitySchemes")
    if schemes:
        components["securitySchemes"] = schemes
    out = {key: value for key, value in document.items() if key not in ("paths", "components")}
    out["paths"] = kept_paths
    out["components"] = components
    return out


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] not in peers.CLAIMED_PATHS:
        raise SystemExit(__doc__)
    peer, source = argv[0], Path(argv[1])
    trimmed = trim(_load(source), tuple(peers.CLAIMED_PATHS[peer]))
    target = peers.spec_path(peer, must_exist=False)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(trimmed, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    print(f"{peer}: {len(trimmed['paths'])} paths -> {target} ({target.stat().st_size} bytes)")


if __name__ == "__main__":
    main(sys.argv[1:])
