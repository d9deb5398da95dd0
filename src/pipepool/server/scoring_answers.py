"""The answers of the scoring routes: Cohere's / Jina's / vLLM's rerank object, TEI's rerank
array, vLLM's ``/score`` and ``/classify`` lists. The models document them in /docs; the
routes build plain dicts."""

from __future__ import annotations

import time

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from .protocol import Usage


class RerankDocument(BaseModel):
    """A document as the rerank answer returns it: as the request gave it ({"text"} for a
    string; every field of an object, as Cohere v1 keeps them)."""

    model_config = ConfigDict(extra="allow")

    text: str | None = None


class RerankResult(BaseModel):
    """One document's rank entry: its index in the request, its score and, when asked
    for, the document."""

    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    """The Cohere / Jina / vLLM rerank answer: results most relevant first, usage and
    Cohere's ``meta``."""

    id: str
    model: str
    results: list[RerankResult]  # most relevant first
    usage: Usage
    meta: dict


class TEIRank(BaseModel):
    """One entry of TEI's rerank answer (a request with ``texts``): a bare array of these,
    most relevant first."""

    index: int
    score: float
    text: str | None = Field(None, description="With return_text.")


# What the rerank routes answer: Cohere's / Jina's object, or TEI's array for TEI's request.
RerankAnswer = RerankResponse | list[TEIRank]


class ScoreData(BaseModel):
    """One pair's score in vLLM's ``/score`` answer."""

    index: int
    object: str = "score"
    score: float


class ScoreResponse(BaseModel):
    """vLLM's ``/score`` answer: one ``ScoreData`` per pair, in request order."""

    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: Usage


class ClassifyData(BaseModel):
    """One text's classification in vLLM's ``/classify`` answer: the top label and every
    label's probability."""

    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassifyResponse(BaseModel):
    """vLLM's ``/classify`` answer: one ``ClassifyData`` per input, in input order."""

    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ClassifyData]
    usage: Usage


def _usage(num_tokens: list[int]) -> dict:
    tokens = int(sum(num_tokens))
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def rerank_response(
    answer_id: str,
    model: str,
    documents: list[dict] | None,
    scores: np.ndarray,
    order: np.ndarray,
    num_tokens: list[int],
) -> dict:
    """Cohere's / Jina's answer; ``documents``: each as returned (None: not returned)."""
    results = []
    for i in order.tolist():
        result = {"index": i, "relevance_score": float(scores[i])}
        if documents is not None:
            result["document"] = documents[i]
        results.append(result)
    usage = _usage(num_tokens)
    return {
        "id": answer_id,
        "model": model,
        "results": results,
        "usage": usage,
        # Cohere's meta: one search unit per request, and the tokens read.
        "meta": {
            "api_version": {"version": "2"},
            "billed_units": {"search_units": 1},
            "tokens": {"input_tokens": usage["prompt_tokens"]},
        },
    }


def tei_rerank_response(
    documents: list[str], scores: np.ndarray, order: np.ndarray, *, return_text: bool
) -> list[dict]:
    """TEI's answer: a bare array of ``{index, score[, text]}``, most relevant first."""
    out = []
    for i in order.tolist():
        item = {"index": i, "score": float(scores[i])}
        if return_text:
            item["text"] = documents[i]
        out.append(item)
    return out


def score_response(answer_id: str, model: str, scores: np.ndarray, num_tokens: list[int]) -> dict:
    return {
        "id": answer_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [
            {"index": i, "object": "score", "score": float(s)}
            for i, s in enumerate(scores.tolist())
        ],
        "usage": _usage(num_tokens),
    }


def classify_response(
    answer_id: str,
    model: str,
    probs: np.ndarray,
    labels: tuple[str, ...],
    num_tokens: list[int],
) -> dict:
    best = probs.argmax(axis=1).tolist() if len(probs) else []
    return {
        "id": answer_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [
            {"index": i, "label": labels[k], "probs": row, "num_classes": len(labels)}
            for i, (k, row) in enumerate(zip(best, probs.tolist(), strict=True))
        ],
        "usage": _usage(num_tokens),
    }
