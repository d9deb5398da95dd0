"""Request and response bodies of Cohere's embed routes, v2 ``POST /v2/embed`` and v1 ``POST
/v1/embed``: every text's embedding in each type asked for; v2 also of ``images`` (a dual
encoder's or a vision-language embedder's) and of ``inputs`` (content parts, texts and images
mixed in one input: a vision-language embedder's). Every field of Cohere's spec is declared,
honoured or refused by name; unknown fields follow ``protocol._Strict``.

int8/uint8 are ``api/int8_scale.py``'s rule (one symmetric scale per model, so a text's
integers are the same in any request) unless the caller gives ``ranges`` (pipepool's):
sentence-transformers' buckets over those ranges. binary/ubinary pack the signs."""

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
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from ..api.quantization import quantize_embeddings, quantize_symmetric
from .encoding import encode_rows
from .openapi import CheckedPositiveInt, Dimensions, Integer, Texts, TokenId
from .protocol import _Strict

# The types of Cohere's embedding_types; int8/uint8 as api/int8_scale.py makes them.
EmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]
InputType = Literal["search_query", "search_document", "classification", "clustering"]
InputTypeV2 = Literal["search_query", "search_document", "classification", "clustering", "image"]
_Images = Annotated[list[StrictStr], Field(json_schema_extra={"minItems": 1})]
_IMAGE_TYPE_HELP = " image: the inputs are images."
Truncate = Literal["NONE", "START", "END"]
_Finite = Annotated[StrictFloat, AllowInfNan(False)]
# Cohere's priority, of which this server has one level (checked, with a message, not typed).
_OnlyZero = Annotated[Integer, Field(json_schema_extra={"enum": [0]})]
_Types = Annotated[list[EmbeddingType], Field(json_schema_extra={"minItems": 1})]
# Refused by name when given (not null), so that a client learns why.
_Refused = Annotated[Any, WithJsonSchema({"type": "null"})]
# Two rows, minimums then maximums (rows of equal length: checked, not stated).
_Ranges = Annotated[list[list[_Finite]], Field(json_schema_extra={"minItems": 2, "maxItems": 2})]
_INPUT_TYPE_HELP = (
    "search_query and search_document take the model's query and document prompts "
    "(sentence-transformers' encode_query / encode_document); classification and clustering a "
    "prompt of that name, where the model has one. Otherwise the model's default prompt, if any."
)
_TYPES_HELP = (
    "float | int8 | uint8 | binary | ubinary | base64 (little-endian float32 bytes of each "
    "vector). int8: round(127 * v / c), clipped to ±127, with c the model's fixed bound (the "
    "largest component over pipepool's calibration texts); uint8: int8 + 128; the same text "
    "gets the same integers in any request. binary/ubinary: the signs, 8 per byte."
)


class _CohereEmbedBody(_Strict):
    """What Cohere's v1 and v2 embed bodies share (text only), plus pipepool's ``ranges``."""

    model: StrictStr | None = Field(None, description="The served model name (default: that one).")
    truncate: Truncate = Field(
        "END",
        description="Texts over the model's length: END cuts their end, START their start, "
        "NONE answers 400.",
    )
    ranges: _Ranges | None = Field(
        None,
        description="pipepool's: int8/uint8 as sentence-transformers' quantize_embeddings with "
        "these ranges, [2, dim] (each dimension's minimum, then maximum), instead of the "
        "model's fixed symmetric scale. Only with int8 or uint8 in embedding_types.",
    )

    @field_validator("ranges")
    @classmethod
    def _two_rows(cls, value: list[list[float]] | None) -> list[list[float]] | None:
        if value is not None and (len(value) != 2 or len(value[0]) != len(value[1])):
            raise ValueError("ranges must be two rows of equal length: minimums, then maximums")
        return value


def _distinct(value: list[EmbeddingType] | None) -> list[EmbeddingType] | None:
    if value is not None and not value:
        raise ValueError("give at least one of float, int8, uint8, binary, ubinary, base64")
    return None if value is None else list(dict.fromkeys(value))  # each once, in order asked


class CohereImageUrl(_Strict):
    """Cohere's ``image_url`` of a content part: its URL (as ``images`` takes them)."""

    url: StrictStr
    detail: Literal["auto"] | None = Field(
        None,
        description="Cohere's; only auto: an image is preprocessed as the checkpoint's image "
        "processor says (low and high are Cohere's own resizing).",
    )


class CohereContentPart(_Strict):
    """One part of an input's content: a text (``type`` text, ``text``) or an image
    (``type`` image_url, ``image_url``)."""

    type: Literal["text", "image_url"]
    text: StrictStr | None = None
    image_url: CohereImageUrl | None = None

    @model_validator(mode="after")
    def _its_own_field(self) -> CohereContentPart:
        if (self.text is None) == (self.type == "text") or (
            (self.image_url is None) == (self.type == "image_url")
        ):
            raise ValueError("a text part holds text only, an image_url part image_url only")
        return self


class CohereEmbedInput(_Strict):
    """One input of v2's ``inputs``: its content parts in order, embedded as one vector."""

    content: Annotated[list[CohereContentPart], Field(min_length=1)]


class CohereEmbedRequest(_CohereEmbedBody):
    """Cohere v2's embed body: ``texts``; or ``images`` (data URIs, files, URLs of allowed
    hosts) with ``input_type`` image, for a dual encoder (CLIP, SigLIP) or a vision-language
    embedder (Qwen2-VL, Qwen2.5-VL, Qwen3-VL); or ``inputs`` (content parts) for a vision-language
    embedder; plus pipepool's ``ranges``."""

    texts: Texts | None = Field(None, description="The texts to embed (or images).")
    images: _Images | None = Field(
        None,
        description="Images to embed, as data URIs (data:image/png;base64,...: jpeg, png, webp, "
        "gif), file:// URIs under --allowed-local-media-path, or http(s) URLs of the hosts "
        "--allowed-media-domains names (others refused), with input_type image; a dual "
        "encoder's (CLIP, SigLIP) or a vision-language embedder's (Qwen2-VL, Qwen2.5-VL, "
        "Qwen3-VL).",
    )
    inputs: Annotated[list[CohereEmbedInput], Field(min_length=1)] | None = Field(
        None,
        description="Inputs of content parts (text, image_url), each embedded as one vector: "
        "one user message of its parts in order, rendered by a vision-language embedder's "
        "chat template (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) as Engine.embed renders a dict input.",
    )
    input_type: InputTypeV2 = Field(description=_INPUT_TYPE_HELP + _IMAGE_TYPE_HELP)
    embedding_types: _Types = Field(["float"], description=_TYPES_HELP)
    output_dimension: Dimensions | None = Field(
        None, description="Matryoshka: keep the first N dimensions (then normalize)."
    )
    max_tokens: CheckedPositiveInt | None = Field(
        None, description="Tokens of each text kept (truncate NONE: longer ones are 400)."
    )
    priority: _OnlyZero | None = Field(
        None,
        description="Cohere's request priority: only 0 (the default, Cohere's highest), which "
        "every request here has; other values are refused (no priority levels here).",
    )

    @field_validator("images")
    @classmethod
    def _not_both(cls, value: list[str] | None, info: ValidationInfo) -> list[str] | None:
        if value is not None and info.data.get("texts") is not None:
            raise ValueError("send texts or images, not both in one request")
        return value

    @field_validator("inputs")
    @classmethod
    def _one_form(cls, value: list | None, info: ValidationInfo) -> list | None:
        if value is not None and (info.data.get("texts") or info.data.get("images")):
            raise ValueError("send texts, images or inputs: one of them in one request")
        return value

    @field_validator("input_type")
    @classmethod
    def _image_type(cls, value: str, info: ValidationInfo) -> str:
        if (value == "image") != (info.data.get("images") is not None):
            raise ValueError("input_type image goes with images, and images with it")
        return value

    @model_validator(mode="after")
    def _texts_or_images(self) -> CohereEmbedRequest:
        if self.texts is None and self.images is None and self.inputs is None:
            raise ValueError("send texts, images or inputs")
        return self

    @field_validator("embedding_types")
    @classmethod
    def _some_types(cls, value: list[EmbeddingType]) -> list[EmbeddingType] | None:
        return _distinct(value)

    @field_validator("priority")
    @classmethod
    def _one_priority(cls, value: int | None) -> int | None:
        if value not in (None, 0):
            raise ValueError(
                "this server serves every request at priority 0 (Cohere's highest) and has no "
                "other levels: leave priority out or send 0"
            )
        return value


class CohereV1EmbedRequest(_CohereEmbedBody):
    """Cohere v1's embed body (text only), plus pipepool's ``ranges``. Without
    ``embedding_types`` the answer is v1's ``embeddings_floats``; with them, by type."""

    texts: Texts = Field(description="The texts to embed.")
    images: _Refused = Field(None, description="Not supported on v1: send images to /v2/embed.")
    input_type: InputType | None = Field(None, description=_INPUT_TYPE_HELP)
    embedding_types: _Types | None = Field(None, description=_TYPES_HELP)

    @field_validator("images")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("v1 embeds texts: send images to /v2/embed")
        return value

    @field_validator("embedding_types")
    @classmethod
    def _some_types(cls, value: list[EmbeddingType] | None) -> list[EmbeddingType] | None:
        return _distinct(value)


class EmbeddingsByType(BaseModel):
    """One embedding per text, in text order, for each type asked for (no other type appears):
    int8/uint8 the integers of the rule above, binary/ubinary the signs packed 8 per byte."""

    model_config = ConfigDict(populate_by_name=True)

    float_: list[list[float]] | None = Field(None, alias="float")
    int8: list[list[int]] | None = None
    uint8: list[list[int]] | None = None
    binary: list[list[int]] | None = None
    ubinary: list[list[int]] | None = None
    base64: list[str] | None = None  # each vector's little-endian float32 bytes


class CohereEmbedResponse(BaseModel):
    """Cohere's by-type embed answer (v2's only one; v1's with ``embedding_types``): the
    embeddings by type, the texts, the tokens read in ``meta.billed_units.input_tokens``."""

    id: str
    embeddings: EmbeddingsByType
    texts: list[str]
    images: list[dict] | None = None  # per image: width, height, format, bit_depth
    meta: dict
    response_type: Literal["embeddings_by_type"] = "embeddings_by_type"


class CohereEmbedFloatsResponse(BaseModel):
    """Cohere v1's answer without ``embedding_types``: one float vector per text."""

    id: str
    embeddings: list[list[float]]
    texts: list[str]
    meta: dict
    response_type: Literal["embeddings_floats"] = "embeddings_floats"


def embed_response(
    texts: list[str],
    vectors: np.ndarray,
    types: list[EmbeddingType] | None,
    num_tokens: list[int],
    int8: tuple[np.ndarray | None, float | None],
    version: str,
    images: list[dict] | None = None,
) -> dict:
    """The answer for ``vectors`` (``[n, dim]`` float32, one per text); ``types`` None: v1's
    floats answer. ``int8``: the caller's ranges, else the model's bound (one of them is given
    where int8 or uint8 is asked for). Raises ``InvalidInputError`` for ranges that do not fit
    the vectors."""
    if types is None:
        embeddings: Any = vectors.tolist()
    else:
        embeddings = {kind: _by_type(vectors, kind, *int8) for kind in types}
    # Images (``images``: each one's Cohere ``Image``) are billed as images, as Cohere does.
    billed = (
        {"images": len(images)} if images is not None else {"input_tokens": int(sum(num_tokens))}
    )
    answer = {
        "id": str(uuid.uuid4()),
        "embeddings": embeddings,
        "texts": texts,
        "meta": {"api_version": {"version": version}, "billed_units": billed},
        "response_type": "embeddings_floats" if types is None else "embeddings_by_type",
    }
    if images is not None:
        answer["images"] = images
    return answer


def _by_type(
    vectors: np.ndarray, kind: str, ranges: np.ndarray | None, bound: float | None
) -> list:
    if kind == "float":
        return vectors.tolist()
    if kind == "base64":
        return encode_rows(vectors, "base64")
    if kind.endswith("binary") or ranges is not None:
        return quantize_embeddings(vectors, kind, ranges).tolist()
    assert bound is not None, "int8/uint8 without ranges need the model's bound"
    return quantize_symmetric(vectors, kind, bound).tolist()


# Cohere's bounds on /v1/tokenize's text and /v1/detokenize's tokens (its spec's).
MAX_TOKENIZE_CHARS = 65536
MAX_DETOKENIZE_TOKENS = 65536


class CohereTokenizeRequest(_Strict):
    """Cohere v1's ``POST /v1/tokenize``: one text to this model's tokens."""

    text: StrictStr = Field(
        description="The text, 1 to 65536 characters.",
        json_schema_extra={"minLength": 1, "maxLength": MAX_TOKENIZE_CHARS},
    )
    model: StrictStr | None = Field(None, description="The served model name (default: that one).")


class CohereTokenizeResponse(BaseModel):
    """The text's tokens without special tokens (as Cohere's client tokenizes offline), and
    each token's piece of the text: from where the previous token ended to where it ends, so
    the pieces put together give the text back (a token that shares its characters with the
    one before, as byte pieces of one character do, has an empty piece)."""

    tokens: list[int]
    token_strings: list[str]
    meta: dict


class CohereDetokenizeRequest(_Strict):
    """Cohere v1's ``POST /v1/detokenize``: this model's token ids back to text."""

    tokens: list[TokenId] = Field(
        description="1 to 65536 token ids, each in [0, vocabulary size).",
        json_schema_extra={"minItems": 1, "maxItems": MAX_DETOKENIZE_TOKENS},
    )
    model: StrictStr | None = Field(None, description="The served model name (default: that one).")


class CohereDetokenizeResponse(BaseModel):
    """The tokens' text, special tokens left out (as Cohere's client decodes offline)."""

    text: str
    meta: dict


def v1_meta() -> dict:
    """``meta`` of a Cohere v1 answer that bills nothing."""
    return {"api_version": {"version": "1"}}
