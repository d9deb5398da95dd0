"""Request and response bodies of the HTTP API: OpenAI's /v1/embeddings, vLLM's /pooling and
/tokenize, TEI's /embed and /tokenize. Unknown fields are ignored (logged at debug level):
OpenAI clients and LangChain send fields of their own that change nothing here."""

from __future__ import annotations

import base64
import logging
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from ..loading.retrieval import OUTPUTS
from .openapi import (
    CheckedPositiveInt,
    Dimensions,
    PromptName,
    Text,
    Texts,
    TokenId,
    TokenIdLists,
    TokenIds,
    TruncateTokens,
    inputs_bound,
    one_of_fields,
)

if TYPE_CHECKING:
    from ..api.retrieval import RetrievalOutputs, SparseEmbedding

Input = Text | Texts | TokenIds | TokenIdLists

_INPUT_HELP = (
    "A string, a list of strings, a list of token ids (one input), or a list of token-id lists "
    "(token ids on a server started with --allow-token-ids only)."
)


log = logging.getLogger("pipepool.server")

LongInputs = Literal["truncate", "error", "chunk"]
EmbedDtype = Literal["float32", "float16", "bfloat16"]
_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# Names checked by the route (a 400 naming the choices), stated in the schema.
_Outputs = Annotated[
    list[Annotated[StrictStr, Field(json_schema_extra={"enum": list(OUTPUTS)})]],
    Field(json_schema_extra={"minItems": 1}),
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow")

    def model_post_init(self, _context: Any) -> None:
        if self.model_extra:
            log.debug("ignoring unknown request fields: %s", ", ".join(sorted(self.model_extra)))


class InputsRequest(_Strict):
    """Fields shared by the requests that run the model."""

    input: Input = Field(description=_INPUT_HELP)
    model: StrictStr | None = Field(None, description="The served model name (default: that one).")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: little-endian bytes of embed_dtype, as OpenAI sends them."
    )
    embed_dtype: EmbedDtype = Field(
        "float32",
        description="vLLM's: the type of the values sent. base64 holds its little-endian bytes; "
        "float, the values rounded through it (round to nearest even).",
    )
    truncate_prompt_tokens: TruncateTokens | None = Field(
        None,
        description="Keep this many tokens of longer inputs (-1: max_model_len) instead of "
        "answering 400.",
    )
    long_inputs: LongInputs | None = Field(
        None,
        description="Inputs over max_model_len: truncate, error (400), or chunk (embed every "
        "window, token-weighted mean). Default: the server's --long-inputs.",
    )
    user: StrictStr | None = Field(None, description="Accepted for compatibility; not used.")

    @field_validator("input", mode="wrap")
    @classmethod
    def _one_clear_input_error(cls, value: Any, handler):
        # A union reports one error per branch; a client needs one sentence.
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(
                "input must be a string, a list of strings, a list of token ids, or a list "
                "of token-id lists"
            ) from None

    def inputs(self) -> list:
        """The inputs as the engine takes them: a list of strings or of token-id lists."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and isinstance(self.input[0], int):
            return [self.input]  # one prompt given as token ids
        return list(self.input)


class EmbeddingRequest(InputsRequest):
    """OpenAI's ``/v1/embeddings`` body (vLLM's extras: ``normalize``, truncation,
    ``long_inputs``; pipepool's: ``outputs`` and their options, for sparse and multi-vector
    models)."""

    dimensions: Dimensions | None = Field(
        None,
        description="Matryoshka: keep the first N dimensions (then normalize); dense only.",
    )
    normalize: StrictBool | None = Field(
        None, description="L2-normalize (default: what the model was trained with)."
    )
    outputs: _Outputs | None = Field(
        None,
        description="What each data item carries, any of: dense (embedding), sparse "
        "(sparse_embedding), multi_vector (one vector per token), from one forward per input. "
        "Default: dense. A model gives only some (SPLADE: sparse; BGE-M3: all three; ColBERT: "
        "multi_vector): asking for another is a 404 naming those it gives.",
    )
    return_tokens: StrictBool = Field(
        False, description="sparse: each index's token string too (sparse_embedding.tokens)."
    )
    # Checked here: a request for other outputs than sparse would not look at it.
    top_k: CheckedPositiveInt | None = Field(
        None, description="sparse: keep the k largest weights."
    )
    is_query: StrictBool = Field(
        False,
        description="multi_vector of a ColBERT model: the query form (query prefix, [MASK] "
        "expansion to the query length) instead of the document form.",
    )


class PoolingRequest(InputsRequest):
    """vLLM's ``/pooling`` body: one embedding per token of each input."""

    normalize: StrictBool = Field(False, description="L2-normalize every token embedding.")


class TokenizeRequest(_Strict):
    """vLLM's ``/tokenize`` body: one text, as ``prompt`` or ``input``."""

    model_config = ConfigDict(json_schema_extra=one_of_fields("prompt", "input", "inputs"))

    prompt: Text | None = Field(None, description="The text to tokenize.")
    input: Text | None = Field(None, description="Same as prompt (give one of them).")
    # TEI tokenizes an empty text, and an empty list, as it is.
    inputs: StrictStr | Annotated[list[StrictStr], inputs_bound(min_items=0)] | None = Field(
        None, description="TEI's form: one text or a list; answered as TEI answers."
    )
    model: StrictStr | None = None
    add_special_tokens: Annotated[StrictBool, Field(json_schema_extra={"const": True})] = Field(
        True, description="Must be true: the model's special tokens are part of every prompt."
    )

    @model_validator(mode="after")
    def _one_text(self) -> TokenizeRequest:
        given = [x for x in (self.prompt, self.input, self.inputs) if x is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of prompt, input or inputs")
        if not self.add_special_tokens:
            raise ValueError("add_special_tokens=false is not supported")
        return self

    @property
    def text(self) -> str:
        """The text given as prompt or input; requests that give TEI's inputs have none."""
        text = self.prompt if self.prompt is not None else self.input
        assert text is not None, "the request gives inputs: it has no single text"
        return text


class DetokenizeRequest(_Strict):
    """vLLM's ``POST /detokenize``: token ids of this model's tokenizer back to text."""

    tokens: list[TokenId] = Field(description="Token ids, each in [0, vocabulary size).")
    model: StrictStr | None = None


class TEIEmbedSparseRequest(_Strict):
    """Hugging Face text-embeddings-inference's ``POST /embed_sparse``."""

    inputs: Text | Texts = Field(description="One text or a list of texts.")
    truncate: StrictBool | None = Field(
        None, description="Truncate inputs over max_model_len (default: the server's policy)."
    )
    truncation_direction: Literal["right", "left", "Right", "Left"] = "right"
    prompt_name: PromptName | None = Field(
        None, description="One of the model's prompts, put before each text."
    )

    def texts(self) -> list[str]:
        return [self.inputs] if isinstance(self.inputs, str) else list(self.inputs)


class TEIEmbedRequest(TEIEmbedSparseRequest):
    """Hugging Face text-embeddings-inference's ``POST /embed``."""

    normalize: StrictBool = Field(True, description="L2-normalize (TEI's default: true).")
    dimensions: Dimensions | None = None


# -- responses (built as plain dicts for speed; the models document them in /docs) ----------


class Usage(BaseModel):
    """Prompt tokens of a request (after truncation), as OpenAI counts them."""

    prompt_tokens: int
    total_tokens: int


class SparseEmbeddingData(BaseModel):
    """One input's sparse vector: token ids ascending, their weights (all > 0), and the
    tokens' strings with ``return_tokens``."""

    indices: list[int]
    values: list[float]
    tokens: list[str] | None = None


class EmbeddingData(BaseModel):
    """One input's outputs, those asked for only: ``embedding`` (dense; floats, or base64 of
    little-endian ``embed_dtype``), ``sparse_embedding``, ``multi_vector`` ([tokens, dim])."""

    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str | None = None
    sparse_embedding: SparseEmbeddingData | None = None
    multi_vector: list[list[float]] | None = None


class TEISparseValue(BaseModel):
    """One non-zero of a sparse vector in TEI's ``/embed_sparse`` answer (indices ascending)."""

    index: int
    value: float


class EmbeddingResponse(BaseModel):
    """OpenAI's ``/v1/embeddings`` answer: one ``EmbeddingData`` per input, in input order."""

    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: Usage


class PoolingData(BaseModel):
    """One input's token embeddings ``[num_tokens, hidden]`` (base64: row-major ``embed_dtype``)."""

    object: Literal["pooling"] = "pooling"
    index: int
    data: list[list[float]] | str  # [num_tokens, hidden]; base64: row-major embed_dtype


class PoolingResponse(BaseModel):
    """vLLM's ``/pooling`` answer: one ``PoolingData`` per input, in input order."""

    object: Literal["list"] = "list"
    data: list[PoolingData]
    model: str
    usage: Usage


class TokenizeResponse(BaseModel):
    """vLLM's answer: every token of the text, never truncated (``count`` is the whole text's;
    an input longer than max_model_len is truncated, refused or chunked by the model routes)."""

    tokens: list[int]
    count: int
    max_model_len: int


class TEIToken(BaseModel):
    """One token in TEI's ``/tokenize`` answer (a list of them per text)."""

    id: int
    text: str
    special: bool
    start: int | None  # character span in the text; None for special tokens
    stop: int | None


class DetokenizeResponse(BaseModel):
    """vLLM's ``/detokenize`` answer: the text of the token ids, special tokens kept."""

    prompt: str


class ModelCard(BaseModel):
    """One served model name in ``/v1/models`` (``max_model_len`` and ``tasks`` once its
    model is loaded)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str  # the model this name is for: the name its responses carry
    max_model_len: int | None = None  # once the model is loaded
    tasks: list[str] | None = None  # what it does (api.router.TASKS), once loaded


class ModelList(BaseModel):
    """OpenAI's ``/v1/models`` answer: every name the server's models answer to."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class VersionResponse(BaseModel):
    """``/version``: the pipepool package version serving."""

    version: str


def encode_array(
    array: np.ndarray, encoding_format: str, embed_dtype: EmbedDtype = "float32"
) -> list | str:
    """A float32 vector (or matrix) as JSON, in ``embed_dtype``: nested floats (the values
    rounded through it), or base64 of its little-endian bytes, row-major."""
    if embed_dtype == "float32":
        if encoding_format == "base64":
            return _base64(np.ascontiguousarray(array, dtype="<f4"))
        return array.tolist()
    # torch rounds to float16 and bfloat16 to nearest even; numpy has no bfloat16.
    narrow = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
    narrow = narrow.to(_TORCH_DTYPES[embed_dtype])
    if encoding_format == "base64":
        return _base64(narrow.view(torch.int16).numpy().astype("<i2", copy=False))
    return narrow.float().numpy().tolist()


def _base64(array: np.ndarray) -> str:
    return base64.b64encode(array.tobytes()).decode("ascii")


def embedding_response(
    model: str,
    outputs: list[np.ndarray],
    num_tokens: list[int],
    encoding_format: str,
    embed_dtype: EmbedDtype = "float32",
) -> dict:
    return _list_response(
        model, "embedding", "embedding", outputs, num_tokens, encoding_format, embed_dtype
    )


def pooling_response(
    model: str,
    outputs: list[np.ndarray],
    num_tokens: list[int],
    encoding_format: str,
    embed_dtype: EmbedDtype = "float32",
) -> dict:
    return _list_response(
        model, "pooling", "data", outputs, num_tokens, encoding_format, embed_dtype
    )


def outputs_response(
    model: str,
    outputs: RetrievalOutputs,
    encoding_format: str,
    embed_dtype: EmbedDtype = "float32",
) -> dict:
    """``/v1/embeddings`` with ``outputs``: each data item with the outputs asked for and no
    other (``encoding_format`` and ``embed_dtype`` apply to ``embedding``, the dense one)."""
    data = []
    for i in range(len(outputs.num_tokens)):
        item: dict[str, Any] = {"object": "embedding", "index": i}
        if outputs.dense is not None:
            item["embedding"] = encode_array(outputs.dense[i], encoding_format, embed_dtype)
        if outputs.sparse is not None:
            sparse = outputs.sparse[i]
            item["sparse_embedding"] = {
                "indices": sparse.indices.tolist(),
                "values": sparse.values.tolist(),
            }
            if sparse.tokens is not None:
                item["sparse_embedding"]["tokens"] = sparse.tokens
        if outputs.multi_vector is not None:
            item["multi_vector"] = outputs.multi_vector[i].tolist()
        data.append(item)
    tokens = int(sum(outputs.num_tokens))
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def tei_sparse_response(sparse: list[SparseEmbedding]) -> list[list[dict]]:
    """TEI's ``/embed_sparse`` answer: per input its non-zeros, ``{index, value}``, indices
    ascending."""
    return [
        [
            {"index": i, "value": v}
            for i, v in zip(s.indices.tolist(), s.values.tolist(), strict=True)
        ]
        for s in sparse
    ]


def _list_response(
    model: str,
    kind: str,
    field: str,
    outputs: list[np.ndarray],
    num_tokens: list[int],
    encoding_format: str,
    embed_dtype: EmbedDtype,
) -> dict:
    tokens = int(sum(num_tokens))
    return {
        "object": "list",
        "data": [
            {"object": kind, "index": i, field: encode_array(out, encoding_format, embed_dtype)}
            for i, out in enumerate(outputs)
        ],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


class ErrorInfo(BaseModel):
    """An OpenAI-style error: what went wrong, its kind, the field at fault and a code."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every 4xx/5xx answer (OpenAI's shape)."""

    error: ErrorInfo
