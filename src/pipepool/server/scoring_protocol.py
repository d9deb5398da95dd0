"""Request bodies of the scoring routes: one ``/rerank`` body for Cohere (v1 and v2), Jina,
vLLM and TEI (``texts``), vLLM's ``/score`` (its four spellings) and ``/classify``. Every field
a peer defines is declared here and honoured with that peer's meaning, or refused by name with
the reason (``scoring_common`` for vLLM's shared fields); the answers are
``scoring_answers``'."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    AllowInfNan,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from .errors import APIError
from .openapi import (
    PAIR_OPTION,
    AnyTexts,
    NonNegativeInt,
    PositiveInt,
    Text,
    Texts,
    TokenIdLists,
    TokenIds,
    TruncateTokens,
    inputs_bound,
    one_of_fields,
)
from .protocol import _Strict
from .rerank_documents import document_texts, returned_documents
from .scoring_answers import (  # noqa: F401  (the routes' names for the answers)
    ClassifyResponse,
    RerankAnswer,
    ScoreResponse,
    classify_response,
    rerank_response,
    score_response,
    tei_rerank_response,
)
from .scoring_common import VllmPoolingFields

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
_PER_QUERY = Field(
    None, description="vLLM's: cut each query to its first N tokens first (0: no cut)."
)
_PER_DOC = Field(
    None,
    description="Cut each document to its first N tokens first (Cohere v2, vLLM; 0: no cut).",
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


class ScoreContent(_Strict):
    """vLLM's multimodal score input: one query or document given as content parts
    (``{"type": "text", "text"}``, ``{"type": "image_url", "image_url": {"url"}}``), read by
    ``routes/page_scoring.py`` (ColQwen2: a query's one text part, a page's one image)."""

    content: Annotated[list[dict[str, Any]], Field(min_length=1)]


# Texts (each may be empty: half of a query-document pair), objects of string fields, or
# vLLM's content parts.
_Documents = Annotated[list[StrictStr | ScoreContent | dict[str, StrictStr]], inputs_bound()]
_ScoreInputs = (
    StrictStr | AnyTexts | ScoreContent
    | Annotated[list[StrictStr | ScoreContent], inputs_bound()]
)  # fmt: skip


@dataclass(frozen=True)
class Truncation:
    """How a request's over-long prompts are cut: at ``tokens`` (None: at max_model_len,
    where ``long_inputs`` or the server's policy truncates), losing tokens from ``side``."""

    side: str  # "right": a prompt keeps its first tokens; "left": its last
    tokens: int | None  # truncate_prompt_tokens
    long_inputs: str | None  # "truncate", "error", or None: the server's --long-inputs


def _no_cut(value: int | None) -> int | None:
    """vLLM's 0 for max_tokens_per_query / max_tokens_per_doc: no cut."""
    return None if value == 0 else value


class RerankRequest(VllmPoolingFields):
    """One rerank body for Cohere (v1: object documents, ``rank_fields``,
    ``max_chunks_per_doc``; v2: ``max_tokens_per_doc``), Jina, vLLM (``top_n``, truncation)
    and TEI (``texts``, ``truncate``, ``truncation_direction``, ``raw_scores``,
    ``return_text``; a TEI-shaped answer). A field of one answer's shape is refused with the
    other's request form (``check_form``)."""

    model_config = ConfigDict(json_schema_extra=one_of_fields("documents", "texts"))

    model: StrictStr | None = Field(None, description="The served model name (default: that one).")
    query: StrictStr | ScoreContent
    documents: _Documents | StrictStr | ScoreContent | None = Field(
        None,
        description="Texts, or objects of string fields (Cohere v1, Jina: ranked by 'text', or "
        "by rank_fields), to rank by the query; one text alone is one document (vLLM).",
    )
    texts: AnyTexts | None = Field(None, description="TEI's name for documents.")
    top_n: NonNegativeInt | None = Field(
        None, description="Return the N most relevant documents (absent or 0: all)."
    )
    return_documents: StrictBool | None = Field(
        None, description="Return each document as given (default: true). Not with texts."
    )
    return_text: StrictBool | None = Field(
        None, description="TEI's, with texts: return each text (default: false)."
    )
    raw_scores: StrictBool | None = Field(
        None, description="TEI's: raw logits instead of the activation (default: false)."
    )
    truncate: StrictBool | None = Field(
        None,
        description="TEI's: true cuts pairs over max_model_len, false refuses them (default: "
        "the server's --long-inputs).",
    )
    truncation_direction: Literal["right", "left", "Right", "Left"] | None = Field(
        None, description="TEI's name for truncation_side."
    )
    rank_fields: Annotated[list[StrictStr], Field(min_length=1)] | None = Field(
        None,
        description="Cohere v1: the fields of object documents to rank by, in this order, as "
        '"key: value" lines. Not with texts.',
    )
    max_chunks_per_doc: PositiveInt | None = Field(
        None,
        description="Cohere v1: score a long document by its first N chunks (each beside the "
        "whole query, filling one prompt), its best chunk's score its score. Cross-encoders "
        "with a pair template only.",
    )
    max_tokens_per_doc: NonNegativeInt | None = _PER_DOC
    max_tokens_per_query: NonNegativeInt | None = _PER_QUERY
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
        """TEI's request form (``texts``): TEI's answer."""
        return self.texts is not None

    def check_form(self) -> None:
        """Refuse the fields of the other request form's answer (a 400 naming the field)."""
        if self.tei:
            for name in ("return_documents", "rank_fields", "request_id"):
                if getattr(self, name) is not None:
                    raise APIError(
                        400,
                        f"{name} shapes the Cohere / Jina / vLLM answer; a request with TEI's "
                        "texts gets TEI's answer (an array of {index, score[, text]}): send "
                        "documents instead of texts",
                        param=name,
                    )
        elif self.return_text is not None:
            raise APIError(
                400,
                "return_text is TEI's, for a request with texts; with documents, "
                "return_documents says whether the answer returns them",
                param="return_text",
            )

    def document_texts(self) -> list[str]:
        """The text each document is scored by (``rerank_documents``)."""
        if self.texts is not None:
            return list(self.texts)
        assert self.documents is not None  # _one_list: exactly one of documents and texts
        return document_texts(self._document_list(), self.rank_fields)

    def returned(self) -> list[dict] | None:
        """The documents the answer returns (Cohere / Jina form; default: all), or None."""
        if self.return_documents is False or self.documents is None:
            return None
        return returned_documents(self._document_list())

    def _document_list(self) -> list[str | dict[str, str]]:
        """The documents of a text model (content parts went to ``routes/page_scoring.py``,
        or were refused there)."""
        documents = self.documents
        assert documents is not None and not isinstance(documents, ScoreContent)
        listed = [documents] if isinstance(documents, str) else documents
        return [d for d in listed if not isinstance(d, ScoreContent)]

    def activation(self) -> bool:
        given = self.use_activation is not None and self.raw_scores is not None
        if given and self.use_activation == self.raw_scores:
            raise APIError(
                400,
                f"use_activation={str(self.use_activation).lower()} and TEI's raw_scores="
                f"{str(self.raw_scores).lower()} ask for opposite scores: send one of them",
                param="raw_scores",
            )
        if self.use_activation is not None:
            return self.use_activation
        return not self.raw_scores

    def truncation(self) -> Truncation:
        """vLLM's and TEI's truncation fields as one rule; a 400 where they contradict."""
        side = self.truncation_side
        direction = self.truncation_direction.lower() if self.truncation_direction else None
        if side is not None and direction is not None and side != direction:
            raise APIError(
                400,
                f"truncation_side {side!r} and TEI's truncation_direction {direction!r} "
                "contradict each other: send one of them",
                param="truncation_direction",
            )
        if self.truncate is False and self.truncate_prompt_tokens is not None:
            raise APIError(
                400,
                "TEI's truncate=false refuses over-long pairs; truncate_prompt_tokens asks to "
                "cut them: send one of them",
                param="truncate",
            )
        long_inputs = {True: "truncate", False: "error", None: None}[self.truncate]
        return Truncation(side or direction or "right", self.truncate_prompt_tokens, long_inputs)

    @property
    def per_doc(self) -> int | None:
        return _no_cut(self.max_tokens_per_doc)

    @property
    def per_query(self) -> int | None:
        return _no_cut(self.max_tokens_per_query)


# vLLM's spellings of /score's two sides, first side first (its current one first).
SCORE_SPELLINGS = (
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
    ("text_1", "text_2"),
)


class ScoreRequest(VllmPoolingFields):
    """vLLM's score: its first side's texts against its second's, 1:1, 1:N (one first text
    against every second one) or N:N (pairwise). The sides are spelled ``queries`` and
    ``documents`` (or ``items``), ``data_1`` and ``data_2``, or ``text_1`` and ``text_2``."""

    model: StrictStr | None = None
    queries: _ScoreInputs | None = Field(
        None, description="One text, scored against every document, or one per document."
    )
    documents: _ScoreInputs | None = None
    items: _ScoreInputs | None = Field(None, description="vLLM's other name for documents.")
    data_1: _ScoreInputs | None = Field(None, description="vLLM's older name for queries.")
    data_2: _ScoreInputs | None = Field(None, description="vLLM's older name for documents.")
    text_1: _ScoreInputs | None = Field(None, description="vLLM's oldest name for queries.")
    text_2: _ScoreInputs | None = Field(None, description="vLLM's oldest name for documents.")
    instruction: _Instruction | None = None
    use_activation: StrictBool | None = _ACTIVATION
    truncate_prompt_tokens: TruncateTokens | None = _TRUNCATE
    max_tokens_per_query: NonNegativeInt | None = _PER_QUERY
    max_tokens_per_doc: NonNegativeInt | None = _PER_DOC
    weights: _Weights | None = _WEIGHTS

    @model_validator(mode="after")
    def _one_spelling(self) -> ScoreRequest:
        given = {
            name for pair in SCORE_SPELLINGS for name in pair if getattr(self, name) is not None
        }
        if not any(given == set(pair) for pair in SCORE_SPELLINGS):
            spelled = ", ".join(f"{a} and {b}" for a, b in SCORE_SPELLINGS)
            found = ", ".join(sorted(given)) or "none"
            raise ValueError(f"give the two sides of the pairs as one of: {spelled} (got {found})")
        return self

    @property
    def sides(self) -> tuple[str, str]:
        """The request's names for its two sides."""
        return next(
            pair for pair in SCORE_SPELLINGS if all(getattr(self, n) is not None for n in pair)
        )

    def truncation(self) -> Truncation:
        return Truncation(self.truncation_side or "right", self.truncate_prompt_tokens, None)

    @property
    def per_doc(self) -> int | None:
        return _no_cut(self.max_tokens_per_doc)

    @property
    def per_query(self) -> int | None:
        return _no_cut(self.max_tokens_per_query)


class ClassifyRequest(VllmPoolingFields):
    """vLLM's classify: label probabilities per input: a text, texts, or (on a server started
    with --allow-token-ids) this model's token ids, as vLLM takes them."""

    model: StrictStr | None = None
    input: Text | Texts | TokenIds | TokenIdLists = Field(
        description="A text, a list of texts, a list of token ids (one input), or a list of "
        "token-id lists (token ids with --allow-token-ids only)."
    )
    use_activation: StrictBool | None = _ACTIVATION
    truncate_prompt_tokens: TruncateTokens | None = _TRUNCATE
    add_special_tokens: StrictBool = Field(
        True, description="Must be true: a classifier reads its inputs with its special tokens."
    )

    @field_validator("add_special_tokens")
    @classmethod
    def _with_special_tokens(cls, value: bool) -> bool:
        if not value:
            raise ValueError(
                "add_special_tokens=false is not supported: a classifier reads its inputs with "
                "the special tokens it was trained with"
            )
        return value

    def inputs(self) -> list:
        """The inputs as the engine takes them: texts, or token-id lists."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and isinstance(self.input[0], int):
            return [self.input]  # one input given as token ids
        return list(self.input)

    def truncation(self) -> Truncation:
        return Truncation(self.truncation_side or "right", self.truncate_prompt_tokens, None)
