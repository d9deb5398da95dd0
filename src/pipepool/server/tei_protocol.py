"""Request bodies of Hugging Face text-embeddings-inference's routes, field for field as TEI
(v1.9) defines them: /embed, /embed_all, /embed_sparse, /predict, /similarity and /decode
(TEI's /rerank body is ``scoring_protocol.RerankRequest``'s ``texts`` form, its /tokenize body
``protocol.TokenizeRequest``'s ``inputs`` form).

TEI ignores a field it does not know; these bodies refuse one (422, naming it), as every
pipepool route refuses an option it would not honour. ``inputs`` takes what TEI takes: a text,
token ids (one input), or a list of either, token ids only on a server started with
``--allow-token-ids``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

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

from .openapi import AnyTexts, Dimensions, PromptName, TokenId, inputs_bound

# TEI's serde aliases: both spellings of each direction.
TruncationDirection = Literal["right", "left", "Right", "Left"]

# One input: a text, or (TEI's Input::Ids) this model's token ids.
TEIInput = StrictStr | Annotated[list[TokenId], Field(json_schema_extra={"x-token-ids": True})]
TEIInputs = TEIInput | Annotated[list[TEIInput], inputs_bound(min_items=0)]

_TRUNCATE = Field(
    None,
    description="Cut inputs over max_input_length (true) or refuse them (false, 422); absent or "
    "null: the server's policy (--long-inputs; /info's auto_truncate).",
)
_DIRECTION: Any = Field(
    "right", description="Which end of a long input is cut: right keeps its start, left its end."
)
_PROMPT_NAME = Field(None, description="One of the model's prompts, put before each text.")


class TEIRequest(BaseModel):
    """A TEI request body: unknown fields are refused (422 naming them), not ignored."""

    model_config = ConfigDict(extra="forbid")


def _one_error(what: str):
    """A wrap validator for a union field: its failure is one sentence saying what the field
    takes (pydantic's would be one error per branch of the union)."""

    def check(cls, value: Any, handler):
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(what) from None

    return field_validator("inputs", mode="wrap")(classmethod(check))


def long_inputs_of(truncate: bool | None) -> str | None:
    """The engine's ``long_inputs`` for TEI's ``truncate``: true cuts, false refuses, absent
    leaves the server's policy in charge (TEI's ``truncate.unwrap_or(auto_truncate)``)."""
    if truncate is None:
        return None
    return "truncate" if truncate else "error"


class TEIInputsRequest(TEIRequest):
    """The fields /embed, /embed_all and /embed_sparse share (TEI's EmbedAllRequest)."""

    inputs: TEIInputs = Field(
        description="A text, a list of token ids (one input), or a list of texts or of token-id "
        "lists (token ids with --allow-token-ids only)."
    )
    truncate: StrictBool | None = _TRUNCATE
    truncation_direction: TruncationDirection = _DIRECTION
    prompt_name: PromptName | None = _PROMPT_NAME

    _inputs = _one_error(
        "must be a text, a list of token ids, or a list of texts or of token-id lists"
    )

    def items(self) -> list:
        """The inputs as a list, each a text or a token-id list (a bare list of ids is one)."""
        inputs = self.inputs
        if isinstance(inputs, str):
            return [inputs]
        if inputs and all(isinstance(x, int) for x in inputs):
            return [inputs]
        return list(inputs)

    def side(self) -> str:
        return self.truncation_direction.lower()


class TEIEmbedSparseRequest(TEIInputsRequest):
    """TEI's ``POST /embed_sparse``."""


class TEIEmbedAllRequest(TEIInputsRequest):
    """TEI's ``POST /embed_all``: every token's embedding (no pooling, no normalisation)."""


class TEIEmbedRequest(TEIInputsRequest):
    """TEI's ``POST /embed``."""

    normalize: StrictBool = Field(True, description="L2-normalize (TEI's default: true).")
    dimensions: Dimensions | None = Field(
        None, description="Matryoshka: keep the first N dimensions (then normalize)."
    )


# A text, or a pair of texts, in TEI's /predict (its Sequence).
Sequence = str | tuple[str, str]


class TEIPredictRequest(TEIRequest):
    """TEI's ``POST /predict``: label scores of one text, of a pair of texts, or of a batch of
    texts and pairs (``[["a"], ["b", "c"]]``)."""

    inputs: StrictStr | list[StrictStr] | list[list[StrictStr]] = Field(
        description="A text, a pair [text, text], or a batch of [text] and [text, text]."
    )
    truncate: StrictBool | None = _TRUNCATE
    truncation_direction: TruncationDirection = _DIRECTION
    raw_scores: StrictBool = Field(False, description="Logits instead of the activation.")

    _inputs = _one_error(
        'must be a text, a pair of texts ["a", "b"], or a batch of them [["a"], ["b", "c"]]'
    )

    @model_validator(mode="after")
    def _sequences_of_one_or_two(self) -> TEIPredictRequest:
        inputs = self.inputs
        if isinstance(inputs, str):
            return self
        if not inputs:
            raise ValueError("inputs: give a text, a pair of texts or a batch of them")
        if isinstance(inputs[0], str):
            if len(inputs) > 2:
                raise ValueError(
                    f"inputs has {len(inputs)} texts: a list of texts is one text or a pair; "
                    'a batch is a list of lists ([["a"], ["b", "c"]])'
                )
            return self
        for i, seq in enumerate(inputs):
            if len(seq) not in (1, 2):
                raise ValueError(f"inputs {i} has {len(seq)} texts: each is [text] or [text, text]")
        return self

    def sequences(self) -> tuple[list[Sequence], bool]:
        """The texts and pairs, and whether the request is a batch (answered as a list of
        lists) rather than one sequence."""
        inputs = self.inputs
        if isinstance(inputs, str):
            return [inputs], False
        if inputs and isinstance(inputs[0], str):
            return [_sequence(inputs)], False
        return [_sequence(seq) for seq in inputs], True  # type: ignore[arg-type]

    def side(self) -> str:
        return self.truncation_direction.lower()


def _sequence(texts: list[str]) -> Sequence:
    return texts[0] if len(texts) == 1 else (texts[0], texts[1])


class TEISimilarityInput(TEIRequest):
    """The texts of a sentence-similarity request."""

    source_sentence: StrictStr = Field(description="The text the others are compared with.")
    sentences: AnyTexts = Field(description="Texts compared with source_sentence.")


class TEISimilarityParameters(TEIRequest):
    """The embedding options of a sentence-similarity request."""

    truncate: StrictBool | None = _TRUNCATE
    truncation_direction: TruncationDirection = _DIRECTION
    prompt_name: PromptName | None = _PROMPT_NAME


class TEISimilarityRequest(TEIRequest):
    """TEI's ``POST /similarity``: the cosine similarity of source_sentence to each of
    sentences, in their order."""

    inputs: TEISimilarityInput
    parameters: TEISimilarityParameters | None = None


class TEIDecodeRequest(TEIRequest):
    """TEI's ``POST /decode``: token ids back to text, one list or a batch of them."""

    ids: list[TokenId] | Annotated[list[list[TokenId]], inputs_bound(min_items=0)] = Field(
        description="Token ids of this model's tokenizer: one list, or a list of lists."
    )
    skip_special_tokens: StrictBool = Field(
        True, description="Leave the special tokens ([CLS], </s>, ...) out of the text."
    )

    def id_lists(self) -> tuple[list[list[int]], bool]:
        """The lists of ids, and whether the request is a batch (rather than one list)."""
        ids: list = self.ids
        if ids and isinstance(ids[0], list):
            return list(ids), True
        return [ids], False


# -- answers (built as plain lists and dicts; the models document them in /docs) -------------


class TEIPrediction(BaseModel):
    """One label's score in TEI's ``/predict`` answer (per input, highest score first)."""

    score: float
    label: str


class TEIErrorResponse(BaseModel):
    """TEI's error body: what went wrong, and TEI's kind of error (``errors.tei_answer``)."""

    error: str
    error_type: Literal[
        "Empty", "Validation", "Tokenizer", "Backend", "Overloaded", "Unhealthy", "Unauthorized"
    ]
