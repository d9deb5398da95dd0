"""Cohere v1's tokenizer routes, so ``cohere.Client.tokenize`` and ``.detokenize`` work as they
are: ``POST /v1/tokenize`` (a text's tokens and their pieces of the text) and ``POST
/v1/detokenize`` (tokens back to text). Cohere's client, when it cannot fetch the model's
tokenizer file (this server offers none), sends the text here; the answers are what its offline
path computes with the model's tokenizer: no special tokens added, none decoded. Neither runs
the model; both are held to Cohere's bounds (1 to 65536 characters, 1 to 65536 tokens) and to
the server's limits, as ``/tokenize`` and ``/detokenize`` are."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Request, Response

from .. import cohere_protocol as cp
from ..errors import APIError
from ..limits import check_text_lengths, check_token_counts
from .answers import json_answer
from .shared import TOKENIZER_ERRORS, select_model, state_of
from .tokens import check_token_ids, served_engine

router = APIRouter(tags=["Cohere"])


@router.post("/v1/tokenize", response_model=cp.CohereTokenizeResponse, responses=TOKENIZER_ERRORS)
async def tokenize(body: cp.CohereTokenizeRequest, request: Request) -> Response:
    """The text's token ids (no special tokens) and each token's piece of the text."""
    state = state_of(request)
    model = select_model(request, body.model)
    engine = served_engine(model)
    text = body.text
    if not 1 <= len(text) <= cp.MAX_TOKENIZE_CHARS:
        raise APIError(
            400,
            f"text has {len(text)} characters; Cohere's tokenize takes 1 to "
            f"{cp.MAX_TOKENIZE_CHARS}",
            param="text",
            code="invalid_value",
        )
    check_text_lengths(state.settings, engine.info, [text], "text", listed=False)

    def build() -> dict:
        encoding = engine.tokenizer.encoding(text, add_special_tokens=False)
        check_token_counts(
            state.settings, engine.info, np.array([len(encoding.ids)]),
            first=0, counted_before=0, inputs=1, param="text", listed=False,
        )  # fmt: skip
        return {
            "tokens": encoding.ids,
            "token_strings": token_pieces(text, encoding.offsets),
            "meta": cp.v1_meta(),
        }

    return await json_answer(request, build, len(text))


@router.post(
    "/v1/detokenize", response_model=cp.CohereDetokenizeResponse, responses=TOKENIZER_ERRORS
)
async def detokenize(body: cp.CohereDetokenizeRequest, request: Request) -> Response:
    """The text of token ids of this model's tokenizer, special tokens left out."""
    state = state_of(request)
    model = select_model(request, body.model)
    engine = served_engine(model)
    tokens = body.tokens
    if not 1 <= len(tokens) <= cp.MAX_DETOKENIZE_TOKENS:
        raise APIError(
            400,
            f"tokens has {len(tokens)} ids; Cohere's detokenize takes 1 to "
            f"{cp.MAX_DETOKENIZE_TOKENS}",
            param="tokens",
            code="invalid_value",
        )
    check_token_ids(state.settings, engine, tokens)
    tokenizer = engine.tokenizer

    def build() -> dict:
        text = tokenizer.backend.decode(tokens, skip_special_tokens=True)
        return {"text": text, "meta": cp.v1_meta()}

    return await json_answer(request, build, len(tokens))


def token_pieces(text: str, offsets: list[tuple[int, int]]) -> list[str]:
    """Each token's piece of ``text``: from where the tokens before it end to where it ends,
    so that the pieces joined are the text up to the last token's end (the spaces before a
    word go with the word, as in Cohere's ``token_strings``). A token ending no later than
    the ones before it (a byte piece of a character another token started) has ``""``."""
    pieces, end = [], 0
    for _, stop in offsets:
        pieces.append(text[end:stop])
        end = max(end, stop)
    return pieces
