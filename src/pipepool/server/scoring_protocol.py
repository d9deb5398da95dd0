"""Request and response bodies of the scoring routes: Cohere's v2 / Jina's ``/rerank`` (with
TEI's form of it), vLLM's ``/score`` and ``/classify``. Unknown fields are ignored, as
elsewhere (Cohere's client sends ``priority`` and ``relevant_spans``)."""

from __future__ import annotations

import time
import uuid
from typing import Annotated

import numpy as np
from pydantic import (
    AliasChoices,
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_validator,
)

from .openapi import (
    PAIR_OPTION,
    AnyTexts,
    NonNegativeInt,
    PositiveInt,
    Text,
    Texts,
    TruncateTokens,
    inputs_bound,
    one_of_fields,
)
from .protocol import Usage, _Strict

_ACTIVATION = Field(
    None,
    validation_alias=AliasChoices("use_activation", "activation"),
    description="false: raw logits instead of the model's activation (sigmoid, softmax).",
)
_TRUNCATE = Field(
    None,
    description="Keep this many tokens of each prompt (-1: max_model_len) instead of the "
    "server's policy for inputs over max_model_len.",
)
_Finite = Annotated[StrictFloat | StrictInt, AllowInfNan(False)]
# Offered where the model takes them (``openapi.bound_schema``): BGE-M3 without a classifier;
# Qwen3-Reranker.
_Weights = Annotated[
    list[_Finite], Field(min_length=3, max_length=3, json_schema_extra={PAIR_OPTION: "weights"})
]
_Instruction = Annotated[StrictStr, Field(json_schema_extra={PAIR_OPTION: "instruction"})]
_WEIGHTS = Field(
    None,
    description="pipepool's, BGE-M3 models only: [w_dense, w_sparse, w_colbert], the score is "
    "FlagEmbedding's colbert+sparse+dense mix (w_dense * dense + w_sparse * sparse + w_colbert "
    "* colbert) / (w_dense + w_sparse + w_colbert). Default [0.4, 0.2, 0.4].",
)


class RerankDocument(BaseModel):
    """A document in a rerank request or answer: its text."""

    text: StrictStr


# Texts (each may be empty: half of a query-document pair) or {text} objects.
_Documents = Annotated[list[StrictStr | RerankDocument], inputs_bound()]


class RerankRequest(_Strict):
    """Cohere v2 / Jina rerank; TEI's form sends ``texts`` instead of ``documents``."""

    model_config = ConfigDict(json_schema_extra=one_of_fields("documents", "texts"))

    model: StrictStr | None = Field(None, description="The served model name (default: that one).")
    query: StrictStr
    documents: _Documents | None = Field(
        None, description="Texts (or {text} objects, Cohere v1 / Jina) to rank by the query."
    )
    texts: AnyTexts | None = Field(None, description="TEI's name for documents.")
    top_n: NonNegativeInt | None = Field(
        None, description="Return the N most relevant documents (absent or 0: all)."
    )
    return_documents: StrictBool | None = Field(
        None, description="Return each document's text (default: true; TEI: return_text)."
    )
    return_text: StrictBool = Field(False, description="TEI's return_documents.")
    raw_scores: StrictBool = Field(False, description="TEI: raw logits instead of the activation.")
    max_tokens_per_doc: PositiveInt | None = Field(
        None, description="Cut each document to its first N tokens first (Cohere v2)."
    )
    instruction: _Instruction | None = Field(
        None, description="Qwen3-Reranker's task instruction (default: its web-search one)."
    )
    use_activation: StrictBool | None = _ACTIVATION
    truncate_prompt_tokens: TruncateTokens | None = _TRUNCATE
    weights: _Weights | None = _WEIGHTS

    @model_validator(mode="after")
    def _one_list(self) -> RerankRequest:
        if (self.documents is None) == (self.texts is None):
            raise ValueError("give the documents to rank as 'documents' (or TEI's 'texts')")
        return self

    @property
    def tei(self) -> bool:
        return self.texts is not None

    def document_texts(self) -> list[str]:
        if self.texts is not None:
            return list(self.texts)
        assert self.documents is not None  # _one_list: exactly one of documents and texts
        return [d if isinstance(d, str) else d.text for d in self.documents]

    def activation(self) -> bool:
        if self.use_activation is not None:
            return self.use_activation
        return not self.raw_scores


class ScoreRequest(_Strict):
    """vLLM's score: one text_1 against every text_2, or text_1[i] with text_2[i]."""

    model: StrictStr | None = None
    text_1: StrictStr | AnyTexts = Field(
        description="One text, scored against every text_2, or as many texts as text_2."
    )
    text_2: StrictStr | AnyTexts
    instruction: _Instruction | None = None
    use_activation: StrictBool | None = _ACTIVATION
    truncate_prompt_tokens: TruncateTokens | None = _TRUNCATE
    weights: _Weights | None = _WEIGHTS


class ClassifyRequest(_Strict):
    """vLLM's classify: label probabilities per input text."""

    model: StrictStr | None = None
    input: Text | Texts
    use_activation: StrictBool | None = _ACTIVATION
    truncate_prompt_tokens: TruncateTokens | None = _TRUNCATE

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


# -- responses (built as plain dicts; the models document them in /docs) ----------------------


class RerankResult(BaseModel):
    """One document's rank entry: its index in the request, its score and, when asked
    for, its text."""

    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    """The Cohere v2 / Jina rerank answer: results most relevant first, usage and
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
    model: str,
    documents: list[str],
    scores: np.ndarray,
    order: np.ndarray,
    num_tokens: list[int],
    *,
    return_documents: bool,
) -> dict:
    results = []
    for i in order.tolist():
        result = {"index": i, "relevance_score": float(scores[i])}
        if return_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    usage = _usage(num_tokens)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
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


def score_response(model: str, scores: np.ndarray, num_tokens: list[int]) -> dict:
    return {
        "id": f"score-{uuid.uuid4().hex}",
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
    model: str, probs: np.ndarray, labels: tuple[str, ...], num_tokens: list[int]
) -> dict:
    best = probs.argmax(axis=1).tolist() if len(probs) else []
    return {
        "id": f"classify-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [
            {"index": i, "label": labels[k], "probs": row, "num_classes": len(labels)}
            for i, (k, row) in enumerate(zip(best, probs.tolist(), strict=True))
        ],
        "usage": _usage(num_tokens),
    }
