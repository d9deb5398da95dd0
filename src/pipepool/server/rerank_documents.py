"""The text a rerank request's documents are scored by, as Cohere v1 and Jina define it: a
string is its own text; an object (Cohere v1's semi-structured documents, Jina's {"text"}) is
ranked by its "text" field, or, with ``rank_fields``, by those fields in that order, one
"key: value" line each (the YAML form Cohere recommends for structured data). The answer
returns each document as it was given."""

from __future__ import annotations

from collections.abc import Sequence

from .errors import APIError

Document = str | dict[str, str]


def document_texts(documents: Sequence[Document], rank_fields: Sequence[str] | None) -> list[str]:
    """The text each document is scored by (module docstring); a 400 naming the document and
    the field when one lacks what it is to be ranked by."""
    if rank_fields is not None:
        _check_rank_fields(rank_fields)
    return [_text(i, d, rank_fields) for i, d in enumerate(documents)]


def returned_documents(documents: Sequence[Document]) -> list[dict]:
    """Each document as the answer returns it: {"text": s} for a string, an object whole."""
    return [{"text": d} if isinstance(d, str) else dict(d) for d in documents]


def _text(i: int, document: Document, rank_fields: Sequence[str] | None) -> str:
    if isinstance(document, str):
        if rank_fields is not None:
            raise APIError(
                400,
                f"document {i} is a string; rank_fields picks fields of documents given as "
                "objects: give every document as an object, or leave rank_fields out",
                param="rank_fields",
            )
        return document
    if rank_fields is None:
        if "text" not in document:
            raise APIError(
                400,
                f"document {i} has no 'text' field, which a document object is ranked by: "
                "give it one, or name the fields to rank by in rank_fields",
                param="documents",
            )
        return document["text"]
    missing = [f for f in rank_fields if f not in document]
    if missing:
        raise APIError(
            400,
            f"document {i} has no field {missing[0]!r}, which rank_fields names",
            param="rank_fields",
        )
    return "\n".join(f"{field}: {document[field]}" for field in rank_fields)


def _check_rank_fields(rank_fields: Sequence[str]) -> None:
    if not rank_fields:
        raise APIError(400, "rank_fields is empty: name at least one field", param="rank_fields")
    if len(set(rank_fields)) != len(rank_fields):
        raise APIError(400, "rank_fields names a field twice", param="rank_fields")
