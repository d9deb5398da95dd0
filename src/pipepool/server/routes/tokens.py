"""The tokenizer's routes: ``POST /tokenize`` in vLLM's form (``prompt`` or ``input``: the ids and
their count) and in TEI's (``inputs``: each token with its text and span), and vLLM's ``POST
/detokenize``. Neither runs the model; both are held to the server's limits (``limits.py``):
inputs per request, tokens per request, and the longest input the server takes. A text is
counted whole, never truncated: its count says what the model routes will truncate, refuse or
chunk."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np
from fastapi import APIRouter, Request, Response

from ...api.engine import Engine
from ...errors import PipepoolError
from ...intake.inputs import valid_texts
from .. import tokens_protocol as tp
from ..errors import APIError, answer_as_tei, from_engine
from ..limits import (
    check_input_count,
    check_text_lengths,
    check_token_counts,
    plain_token_ids,
    too_many_tokens,
)
from ..models import ServedModel
from ..settings import ServerSettings
from .shared import TOKENIZER_ERRORS, ServerState, select_model, state_of
from .tei import TEI_TOKENIZER_FORM_ERRORS

T = TypeVar("T")

router = APIRouter()

# Characters of text the TEI form tokenises at a time: a request over the token limit stops
# within a batch of it, and its token objects are built only once it is known to be within.
_BATCH_CHARS = 1 << 16
# Characters of text whose token objects the TEI form builds and writes as JSON at a time: the
# JSON encoder holds the interpreter's lock for all it is given, and the event loop waits for
# it meanwhile (a whole 2,048-text answer: ~0.3 s); a piece of this size takes about 1 ms.
_DESCRIBE_CHARS = 1 << 12


@router.post(
    "/tokenize",
    response_model=tp.TokenizeResponse | list[list[tp.TEIToken]],
    responses={**TOKENIZER_ERRORS, **TEI_TOKENIZER_FORM_ERRORS},
)
async def tokenize(body: tp.TokenizeRequest, request: Request) -> Response:
    """Token ids of a text, special tokens (and the model's default prompt) included, as the
    model routes see them before any truncation: ``count`` is the whole text's. With
    ``add_special_tokens`` false, the special tokens left out; with ``return_token_strs``,
    each token's vocabulary string too (vLLM's ``token_strs``). With TEI's ``inputs`` (one
    text or a list), TEI's answer: per text, its tokens as ``{id, text, special, start,
    stop}`` (and TEI's errors)."""
    if body.inputs is not None:
        answer_as_tei(request.scope)
    state = state_of(request)
    model = select_model(request, body.model)
    engine = served_engine(model)
    if body.inputs is not None:
        if body.return_token_strs:
            raise APIError(
                400,
                "return_token_strs is vLLM's, for the prompt (or input) form; TEI's inputs "
                "form gives each token's text already",
                param="return_token_strs",
                code="invalid_value",
            )
        texts = [body.inputs] if isinstance(body.inputs, str) else list(body.inputs)
        return await _tei_tokenize(state, model, engine, texts, body.add_special_tokens)
    param = "prompt" if body.prompt is not None else "input"
    text = body.text
    check_text_lengths(state.settings, engine.info, [text], param, listed=False)

    def count() -> dict:
        if body.add_special_tokens:
            # "chunk": the engine neither truncates nor refuses a long text then.
            (ids,) = engine.tokenize([text], long_inputs="chunk")
        else:
            (ids,) = plain_token_ids(engine, [text], param)
        lengths = np.array([len(ids)])
        check_token_counts(
            state.settings, engine.info, lengths,
            first=0, counted_before=0, inputs=1, param=param, listed=False,
        )  # fmt: skip
        answer = {
            "tokens": ids.tolist(),
            "count": len(ids),
            "max_model_len": engine.info.max_model_len,
        }
        if body.return_token_strs:
            backend = engine.tokenizer.backend
            answer["token_strs"] = [backend.id_to_token(i) for i in answer["tokens"]]
        return answer

    return _json(await _offloaded(model, count, len(text)))


@router.post("/detokenize", response_model=tp.DetokenizeResponse, responses=TOKENIZER_ERRORS)
async def detokenize(body: tp.DetokenizeRequest, request: Request) -> Response:
    """The text of token ids of this model's tokenizer, special tokens included (vLLM)."""
    state = state_of(request)
    model = select_model(request, body.model)
    engine = served_engine(model)
    check_token_ids(state.settings, engine, body.tokens)
    tokenizer = engine.tokenizer
    prompt = await model.front.offload(
        lambda: tokenizer.backend.decode(body.tokens, skip_special_tokens=False),
        size=len(body.tokens),
    )
    return _json({"prompt": prompt})


async def _tei_tokenize(
    state: ServerState,
    model: ServedModel,
    engine: Engine,
    texts: list[str],
    add_special_tokens: bool,
) -> Response:
    settings, info = state.settings, engine.info
    check_input_count(settings, len(texts), "inputs")
    check_text_lengths(settings, info, texts, "inputs")
    tokenizer = engine.tokenizer

    def describe() -> str:
        # Valid Unicode (the guards turned away JSON's lone surrogates already), empty allowed.
        checked = valid_texts(texts, param="inputs", allow_empty=True)
        total = 0
        for lo, hi in _batches(checked):  # counted first: token objects cost far more
            _, lengths = tokenizer.encode_flat(checked[lo:hi])
            total = check_token_counts(
                settings, info, lengths,
                first=lo, counted_before=total, inputs=len(checked), param="inputs",
            )  # fmt: skip
        # The answer's list, a piece of it at a time (``_DESCRIBE_CHARS``).
        pieces = (
            _dumps(tokenizer.describe(checked[lo:hi], add_special_tokens=add_special_tokens))
            for lo, hi in _batches(checked, _DESCRIBE_CHARS)
        )
        return "[" + ",".join(piece[1:-1] for piece in pieces) + "]"

    text = await _offloaded(model, describe, sum(map(len, texts)))
    return Response(text, media_type="application/json")


def served_engine(model: ServedModel) -> Engine:
    """The model's engine; a 503 while it loads or after it failed to start."""
    try:
        return model.front.engine
    except PipepoolError as exc:
        raise from_engine(exc) from None


def check_token_ids(settings: ServerSettings, engine: Engine, tokens: list[int]) -> None:
    """A detokenize request's ``tokens``: at most --max-tokens-per-request of them, each in the
    model's vocabulary; else a 400 naming the first that is not."""
    if len(tokens) > settings.max_tokens_per_request:
        raise too_many_tokens(settings, len(tokens), "tokens")
    vocab = engine.tokenizer.vocab_size
    for i, token in enumerate(tokens):
        if not 0 <= token < vocab:
            raise APIError(
                400,
                f"tokens {i} is {token}, outside this model's vocabulary [0, {vocab})",
                param="tokens",
                code="invalid_value",
            )


async def _offloaded(model: ServedModel, fn: Callable[[], T], size: int) -> T:
    """``fn()`` on a worker thread of ``model``'s (by ``size``, in characters), engine errors
    as 4xx/5xx."""
    try:
        return await model.front.offload(fn, size=size)
    except PipepoolError as exc:
        raise from_engine(exc) from None


def _batches(texts: list[str], size: int = _BATCH_CHARS) -> Iterator[tuple[int, int]]:
    """``[lo, hi)`` of consecutive texts of about ``size`` characters (at least one)."""
    lo, chars = 0, 0
    for hi, text in enumerate(texts, start=1):
        chars += len(text)
        if chars >= size:
            yield lo, hi
            lo, chars = hi, 0
    if lo < len(texts):
        yield lo, len(texts)


def _dumps(body: object) -> str:
    return json.dumps(body, separators=(",", ":"))


def _json(body: object) -> Response:
    return Response(_dumps(body), media_type="application/json")
