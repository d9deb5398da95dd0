"""Request and response bodies of the HTTP API: OpenAI's /v1/embeddings, TEI's /embed and
/embed_sparse, and the answers the routes share (vLLM's /pooling: ``pooling_protocol.py``; the
tokenizer's routes: ``tokens_protocol.py``). Every request model takes only the fields it
declares (``strict.py``: an unknown field is a 400 naming it); how vectors are written:
``encoding.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

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
from pydantic.json_schema import SkipJsonSchema

from ..loading.retrieval import OUTPUTS
from .chat_protocol import ChatFields, missing_input
from .encoding import EmbedDtype, EncodingFormat, Endianness, Vectors, Wire
from .encoding import encode_array as encode_array  # tests import it from here
from .openapi import (
    CheckedPositiveInt,
    Dimensions,
    Text,
    Texts,
    TokenIdLists,
    TokenIds,
    TruncateTokens,
    one_of_fields,
)
from .strict import StrictRequest

if TYPE_CHECKING:
    from ..api.retrieval import RetrievalOutputs, SparseEmbedding

Input = Text | Texts | TokenIds | TokenIdLists

_INPUT_HELP = (
    "A string, a list of strings, a list of token ids (one input), or a list of token-id lists "
    "(token ids on a server started with --allow-token-ids only)."
)


LongInputs = Literal["truncate", "error", "chunk"]
# Names checked by the route (a 400 naming the choices), stated in the schema.
_Outputs = Annotated[
    list[Annotated[StrictStr, Field(json_schema_extra={"enum": list(OUTPUTS)})]],
    Field(json_schema_extra={"minItems": 1}),
]
# The request models of the other route families derive from it by this name.
_Strict = StrictRequest


class InputsRequest(ChatFields, _Strict):
    """Fields shared by the requests that run the model: ``input``, or vLLM's chat form
    (``messages``, ``chat_protocol.py``)."""

    model_config = ConfigDict(json_schema_extra=one_of_fields("input", "messages"))

    # Null is not a value to send: the body holds input or messages (the model's schema says).
    input: Input | SkipJsonSchema[None] = Field(None, description=_INPUT_HELP)
    model: StrictStr | None = Field(None, description="The served model name (default: that one).")
    encoding_format: EncodingFormat = Field(
        "float",
        description="float: JSON numbers. base64: the bytes of embed_dtype in endianness, as "
        "OpenAI sends them. bytes, bytes_only (vLLM's): those bytes as the body itself "
        "(application/octet-stream), every input's one after the other; bytes adds a "
        "'metadata' header (JSON: id, created, model, usage, and per input its byte range "
        "and shape).",
    )
    embed_dtype: EmbedDtype = Field(
        "float32",
        description="vLLM's: the type of the values sent. base64 and bytes hold its bytes; "
        "float, the values rounded through it (round to nearest even).",
    )
    endianness: Endianness = Field(
        "native",
        description="vLLM's: the byte order of base64 and bytes (native: the server's). "
        "Numbers in JSON (float) have none.",
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
    add_special_tokens: StrictBool = Field(
        True,
        description="vLLM's: false leaves out the special tokens the model adds to a text "
        "([CLS], [SEP], BOS, ...); the model's default prompt stays. Token-id inputs are "
        "taken as they are.",
    )
    truncation_side: Literal["left", "right"] | None = Field(
        None,
        description="vLLM's: where an input over truncate_prompt_tokens (or max_model_len, "
        "where the server truncates) is cut. right (default) keeps its first tokens, left its "
        "last; the special tokens stay.",
    )
    normalize: StrictBool | None = Field(
        None,
        description="L2-normalize each vector (default: what the model was trained with; "
        "/pooling's token_embed: false).",
    )
    use_activation: StrictBool | None = Field(
        None,
        description="vLLM's newer name for normalize; on /pooling's classify and "
        "token_classify, the model's activation (softmax, sigmoid) or, false, raw logits. "
        "Given with normalize, the two must agree.",
    )
    user: StrictStr | None = Field(
        None, description="OpenAI's end-user id, for abuse monitoring; it changes no answer."
    )

    @model_validator(mode="after")
    def _normalize_agrees(self) -> InputsRequest:
        given = {self.normalize, self.use_activation} - {None}
        if len(given) > 1:
            raise ValueError("normalize and use_activation (vLLM's name for it) disagree")
        return self

    @property
    def normalized(self) -> bool | None:
        """Whether to L2-normalize embeddings: normalize or use_activation, None if neither."""
        return self.normalize if self.normalize is not None else self.use_activation

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

    @property
    def wire(self) -> Wire:
        """How the answer writes its vectors."""
        return Wire(self.encoding_format, self.embed_dtype, self.endianness)

    def inputs(self) -> list:
        """The inputs as the engine takes them: a list of strings or of token-id lists; 400
        where the body has none (messages go to ``routes/chat_embeddings.py`` instead)."""
        if self.input is None:
            raise missing_input(self.messages is not None)
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
    outputs: _Outputs | None = Field(
        None,
        description="What each data item carries, any of: dense (embedding), sparse "
        "(sparse_embedding), multi_vector (one vector per token), from one forward per input. "
        "Default: dense. A model gives only some (SPLADE: sparse; BGE-M3: all three; ColBERT: "
        "multi_vector): asking for another is a 400 naming those it gives. encoding_format "
        "bytes carries dense vectors only.",
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
    late_chunking: StrictBool = Field(
        False,
        description="Jina's: the inputs are consecutive chunks of one document (texts), run "
        "through the model as one and each pooled from the document's token states (late "
        "chunking; documents longer than the model's context in overlapping windows). Dense "
        "outputs only; no truncation options.",
    )


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


class ModelCard(BaseModel):
    """One served model name in ``/v1/models`` (``max_model_len`` and ``tasks`` once its
    model is loaded)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str  # the model this name is for: the name its responses carry
    max_model_len: int | None = None  # once the model is loaded
    tasks: list[str] | None = None  # what it does (api.routing.TASKS), once loaded
    # Cohere's fields (its client's models.get / models.list; server/model_cards.py).
    name: str
    is_deprecated: bool = False
    endpoints: list[str]
    default_endpoints: list[str]
    finetuned: bool = False
    context_length: int | None = None  # left out while the model loads
    features: list[str] = []


class ModelList(BaseModel):
    """OpenAI's ``/v1/models`` answer (``data``), which is also Cohere's (``models``, the
    same cards, and ``next_page_token``): every name the server's models answer to."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
    models: list[ModelCard]
    next_page_token: str | None = None


class VersionResponse(BaseModel):
    """``/version``: the pipepool package version serving."""

    version: str


def embedding_response(model: str, outputs: Vectors, num_tokens: list[int], wire: Wire) -> dict:
    """OpenAI's ``/v1/embeddings`` answer (JSON ``wire`` formats)."""
    return list_response(model, "embedding", "embedding", outputs, num_tokens, wire)


def outputs_response(model: str, outputs: RetrievalOutputs, wire: Wire) -> dict:
    """``/v1/embeddings`` with ``outputs``: each data item with the outputs asked for and no
    other (``wire`` applies to ``embedding``, the dense one)."""
    data = []
    for i in range(len(outputs.num_tokens)):
        item: dict[str, Any] = {"object": "embedding", "index": i}
        if outputs.dense is not None:
            item["embedding"] = wire.json(outputs.dense[i])
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


def list_response(
    model: str,
    kind: str,
    field: str,
    outputs: Vectors,
    num_tokens: list[int],
    wire: Wire,
    head: dict | None = None,
) -> dict:
    """A list answer of OpenAI's shape: per input ``{"object": kind, "index", field: its
    output}`` in input order, the model, the usage; ``head``'s fields first (vLLM's ``id``
    and ``created``)."""
    tokens = int(sum(num_tokens))
    return {
        **(head or {}),
        "object": "list",
        "data": [
            {"object": kind, "index": i, field: value}
            for i, value in enumerate(wire.json_rows(outputs))
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
