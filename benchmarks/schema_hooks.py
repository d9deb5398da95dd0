"""Schemathesis hooks (``SCHEMATHESIS_HOOKS=schema_hooks``) for what the server's OpenAPI
schema states in words but JSON Schema cannot: it compares no two fields and counts no tokens.

The rules are applied to the bodies schemathesis draws as valid (its positive cases), in
every phase, so that a valid body also keeps the rule the schema describes; the bodies it draws
as invalid are sent as drawn. The server's answers to bodies that break those rules are pinned
by tests (``tests/test_rerank_server.py``, ``tests/test_v2_embed.py``).
"""

from __future__ import annotations

from typing import Any

import schemathesis
from schemathesis import GenerationMode

# The embedder's (the bundled MiniLM's) max_seq_length: the server's length for a text, special
# tokens included.
MODEL_TOKENS = 256
# Special tokens around one text ([CLS] ... [SEP]).
SPECIAL_TOKENS = 2
# The embedder's vector size.
MODEL_DIMENSIONS = 384


@schemathesis.hook("map_case").apply_to(path_regex="^/(v1/)?score$", method="POST")
def pairs_of_one_count(context: Any, case: Any) -> Any:
    """``text_1`` is one text (scored against each of ``text_2``) or as many texts as
    ``text_2`` (a string counts as one): where a valid body has several ``text_1`` and another
    number of ``text_2``, the fewer are repeated up to the count of the more (which the
    schema's ``maxItems`` already allows)."""
    body = case.body
    if not _positive(case) or not isinstance(body, dict):
        return case
    first, second = body.get("text_1"), body.get("text_2")
    if not (_texts(first) and _texts(second)):
        return case
    firsts, seconds = _as_list(first), _as_list(second)
    if len(firsts) < 2 or len(firsts) == len(seconds) or not seconds:
        return case
    count = max(len(firsts), len(seconds))
    body["text_1"], body["text_2"] = _repeated(firsts, count), _repeated(seconds, count)
    return case


@schemathesis.hook("map_case").apply_to(path_regex="^/v[12]/embed$", method="POST")
def cohere_embed_rules(context: Any, case: Any) -> Any:
    """Two rules of a valid body (Cohere's v1 and v2). ``truncate: "NONE"`` answers 400 for a
    text of more tokens, special ones included, than the model's length or ``max_tokens``:
    where a text could be that long, the body asks for ``"END"`` instead (a WordPiece token
    covers at least one character, so a text of at most ``limit - 2`` characters fits).
    ``ranges`` holds a minimum and a maximum for each dimension of the vectors
    (``output_dimension`` or the model's), and places int8/uint8 buckets: rows of another
    length, or ranges without int8 or uint8 asked for, are dropped (the field is optional)."""
    body = case.body
    if not _positive(case) or not isinstance(body, dict):
        return case
    texts = body.get("texts")
    if body.get("truncate") == "NONE" and isinstance(texts, list):
        limit = MODEL_TOKENS
        max_tokens = body.get("max_tokens")
        if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
            limit = min(limit, max_tokens)
        if any(isinstance(t, str) and len(t) > limit - SPECIAL_TOKENS for t in texts):
            body["truncate"] = "END"
    ranges, dims = body.get("ranges"), body.get("output_dimension")
    dims = dims if isinstance(dims, int) and not isinstance(dims, bool) else MODEL_DIMENSIONS
    if isinstance(ranges, list) and any(not isinstance(r, list) or len(r) != dims for r in ranges):
        body["ranges"] = None
    types = body.get("embedding_types")
    if not (isinstance(types, list) and {"int8", "uint8"} & set(types)):
        body.pop("ranges", None)
    return case


@schemathesis.hook("filter_case").apply_to(path="/v1/files", method="POST")
def file_parts_hold_bytes(context: Any, case: Any) -> bool:
    """A multipart file part is bytes: schemathesis writes a drawn JSON null or number there as
    its text (``null``), which is a valid file, and would count the upload as a schema
    violation the server accepted. Such draws are skipped; every other body is sent."""
    body = case.body
    if not isinstance(body, dict) or "file" not in body:
        return True
    return isinstance(body["file"], str | bytes)


def _positive(case: Any) -> bool:
    meta = case.meta
    return meta is None or meta.generation.mode == GenerationMode.POSITIVE


def _texts(value: object) -> bool:
    return isinstance(value, str) or (
        isinstance(value, list) and all(isinstance(v, str) for v in value)
    )


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else value


def _repeated(items: list, count: int) -> list:
    return [items[i % len(items)] for i in range(count)]
