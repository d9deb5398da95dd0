"""Request and response bodies of Cohere's v2 ``POST /v2/embed``: every text's embedding in
each type asked for. Text only: ``images`` and ``inputs`` are refused by name. Unknown fields
are ignored, as elsewhere (Cohere's client may send ``priority``)."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictStr,
    WithJsonSchema,
    field_validator,
)

from ..api.quantization import quantize_embeddings
from .openapi import CheckedPositiveInt, Dimensions, Texts
from .protocol import _Strict, encode_array

# The types of Cohere's embedding_types; the int8..ubinary ones are sentence-transformers'
# precisions of the same names.
EmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]
InputType = Literal["search_query", "search_document", "classification", "clustering"]
Truncate = Literal["NONE", "START", "END"]
_Finite = Annotated[StrictFloat, AllowInfNan(False)]
_Types = Annotated[list[EmbeddingType], Field(json_schema_extra={"minItems": 1})]
# Refused by name when given (not null), so that a client learns why.
_Refused = Annotated[Any, WithJsonSchema({"type": "null"})]
# Two rows, minimums then maximums (rows of equal length: checked, not stated).
_Ranges = Annotated[list[list[_Finite]], Field(json_schema_extra={"minItems": 2, "maxItems": 2})]


class CohereEmbedRequest(_Strict):
    """Cohere v2's embed body (text only), plus pipepool's ``ranges``."""

    model: StrictStr | None = Field(None, description="The served model name (default: that one).")
    images: _Refused = Field(None, description="Not supported: this server embeds text.")
    inputs: _Refused = Field(None, description="Not supported: send texts.")
    texts: Texts = Field(description="The texts to embed.")
    input_type: InputType = Field(
        description="search_query and search_document take the model's query and document "
        "prompts (sentence-transformers' encode_query / encode_document); classification and "
        "clustering a prompt of that name, where the model has one. Otherwise the model's "
        "default prompt, if any."
    )
    embedding_types: _Types = Field(
        ["float"],
        description="float | int8 | uint8 | binary | ubinary | base64 (little-endian float32 "
        "bytes of each vector); each as sentence-transformers' quantize_embeddings makes it.",
    )
    truncate: Truncate = Field(
        "END",
        description="Texts over the model's length (or max_tokens): END cuts their end, START "
        "their start, NONE answers 400.",
    )
    output_dimension: Dimensions | None = Field(
        None, description="Matryoshka: keep the first N dimensions (then normalize)."
    )
    max_tokens: CheckedPositiveInt | None = Field(
        None, description="Tokens of each text kept (truncate NONE: longer ones are 400)."
    )
    ranges: _Ranges | None = Field(
        None,
        description="pipepool's: int8/uint8 buckets as quantize_embeddings' ranges, [2, dim] "
        "(each dimension's minimum, then maximum). Default: the range of this request's "
        "vectors, which differs from request to request; send fixed ranges (from a "
        "calibration set) to get comparable integers across requests.",
    )

    @field_validator("images", "inputs")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("this server embeds text only: send texts")
        return value

    @field_validator("embedding_types")
    @classmethod
    def _some_types(cls, value: list[EmbeddingType]) -> list[EmbeddingType]:
        if not value:
            raise ValueError("give at least one of float, int8, uint8, binary, ubinary, base64")
        return list(dict.fromkeys(value))  # each once, in the order asked

    @field_validator("ranges")
    @classmethod
    def _two_rows(cls, value: list[list[float]] | None) -> list[list[float]] | None:
        if value is not None and (len(value) != 2 or len(value[0]) != len(value[1])):
            raise ValueError("ranges must be two rows of equal length: minimums, then maximums")
        return value


class EmbeddingsByType(BaseModel):
    """One embedding per text, in text order, for each type asked for (no other type appears):
    int8/uint8 are bucket numbers, binary/ubinary the signs packed 8 per byte."""

    model_config = ConfigDict(populate_by_name=True)

    float_: list[list[float]] | None = Field(None, alias="float")
    int8: list[list[int]] | None = None
    uint8: list[list[int]] | None = None
    binary: list[list[int]] | None = None
    ubinary: list[list[int]] | None = None
    base64: list[str] | None = None  # each vector's little-endian float32 bytes


class CohereEmbedResponse(BaseModel):
    """Cohere v2's embed answer: the embeddings by type, the texts, the tokens read in
    ``meta.billed_units.input_tokens``."""

    id: str
    embeddings: EmbeddingsByType
    texts: list[str]
    meta: dict
    response_type: Literal["embeddings_by_type"] = "embeddings_by_type"


def embed_response(
    texts: list[str],
    vectors: np.ndarray,
    types: list[EmbeddingType],
    num_tokens: list[int],
    ranges: list[list[float]] | None,
) -> dict:
    """The answer for ``vectors`` (``[n, dim]`` float32, one per text); raises
    ``InvalidInputError`` for ``ranges`` that do not fit the vectors."""
    limits = None if ranges is None else np.asarray(ranges)
    return {
        "id": str(uuid.uuid4()),
        "embeddings": {kind: _by_type(vectors, kind, limits) for kind in types},
        "texts": texts,
        "meta": {
            "api_version": {"version": "2"},
            "billed_units": {"input_tokens": int(sum(num_tokens))},
        },
        "response_type": "embeddings_by_type",
    }


def _by_type(vectors: np.ndarray, kind: str, ranges: np.ndarray | None) -> list:
    if kind == "float":
        return vectors.tolist()
    if kind == "base64":
        return [encode_array(v, "base64") for v in vectors]
    return quantize_embeddings(vectors, kind, ranges).tolist()
