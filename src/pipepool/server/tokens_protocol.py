"""The bodies of the tokenizer's routes (``routes/tokens.py``): vLLM's ``/tokenize`` and
``/detokenize``, and TEI's ``/tokenize`` (its ``inputs`` form)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

from .openapi import Text, TokenId, inputs_bound, one_of_fields
from .strict import StrictRequest


class TokenizeRequest(StrictRequest):
    """vLLM's ``/tokenize`` body: one text, as ``prompt`` or ``input``."""

    model_config = ConfigDict(json_schema_extra=one_of_fields("prompt", "input", "inputs"))

    prompt: Text | None = Field(None, description="The text to tokenize.")
    input: Text | None = Field(None, description="Same as prompt (give one of them).")
    # TEI tokenizes an empty text, and an empty list, as it is.
    inputs: StrictStr | Annotated[list[StrictStr], inputs_bound(min_items=0)] | None = Field(
        None, description="TEI's form: one text or a list; answered as TEI answers."
    )
    model: StrictStr | None = None
    add_special_tokens: StrictBool = Field(
        True,
        description="false: the text's tokens alone (the model's default prompt kept), "
        "without the special tokens the model adds ([CLS], [SEP], BOS, ...).",
    )
    return_token_strs: StrictBool = Field(
        False,
        description="vLLM's: each token's string in the vocabulary, as token_strs (prompt or "
        "input form).",
    )

    @model_validator(mode="after")
    def _one_text(self) -> TokenizeRequest:
        given = [x for x in (self.prompt, self.input, self.inputs) if x is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of prompt, input or inputs")
        return self

    @property
    def text(self) -> str:
        """The text given as prompt or input; requests that give TEI's inputs have none."""
        text = self.prompt if self.prompt is not None else self.input
        assert text is not None, "the request gives inputs: it has no single text"
        return text


class DetokenizeRequest(StrictRequest):
    """vLLM's ``POST /detokenize``: token ids of this model's tokenizer back to text."""

    tokens: list[TokenId] = Field(description="Token ids, each in [0, vocabulary size).")
    model: StrictStr | None = None


class TokenizeResponse(BaseModel):
    """vLLM's answer: every token of the text, never truncated (``count`` is the whole text's;
    an input longer than max_model_len is truncated, refused or chunked by the model routes)."""

    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None  # with return_token_strs: each token's string


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
