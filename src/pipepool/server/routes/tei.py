"""Hugging Face text-embeddings-inference's embedding routes, so TEI clients (``huggingface_hub``'s
``InferenceClient``, LangChain's and LlamaIndex's TEI classes) work as they are: ``POST /embed``
(a vector per input), ``/embed_all`` (every token's vector), ``/similarity`` (cosines to a
source sentence), ``/decode`` (token ids to text) and ``GET /info``; ``/predict`` is in
``tei_predict.py``, ``POST /`` in ``tei_root.py``, ``/embed_sparse`` in ``retrieval.py``,
``/rerank`` in ``scoring.py``, ``/tokenize`` in ``tokens.py``. Errors have TEI's body and
statuses (``errors.tei_answer``); the checks TEI makes before a model call are ``tei_inputs``."""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi import APIRouter, Request, Response

from ...errors import PipepoolError
from ..encoding import encode_rows, values_in
from ..errors import EMPTY, APIError, from_engine
from ..fast_route import FastBodyRoute
from ..limits import check_input_count, too_many_tokens
from ..tei_info import tei_info
from ..tei_protocol import (
    TEIDecodeRequest,
    TEIEmbedAllRequest,
    TEIEmbedRequest,
    TEIErrorResponse,
    TEISimilarityRequest,
    long_inputs_of,
)
from .answers import json_answer
from .shared import run_model_outputs, select_model, state_of

router = APIRouter(tags=["TEI"], route_class=FastBodyRoute)

# TEI's error answers (TEI's ErrorResponse body) of a route that runs the model, and of one
# that does not.
_MEANING = {
    400: "Empty: no inputs, or an empty one.",
    401: "Missing or wrong API key (a server started with --api-key).",
    408: "Validation: the request body did not arrive within --body-timeout.",
    413: "Validation: more inputs than max_client_batch_size (--max-inputs-per-request), or a "
    "body over --max-body-bytes.",
    422: "Validation: a bad or unknown field, token ids without --allow-token-ids, an input "
    "over max_input_length with truncate false, too many tokens in all.",
    424: "Backend: the model does not do what the route asks (an embedding model's /predict).",
    429: "Overloaded: the model's queue is full; retry after Retry-After seconds.",
    500: "Backend: internal error (the server's log has the details).",
    503: "Unhealthy: the model is loading or restarting, or its engine failed.",
}


def tei_errors_doc(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The error answers of a TEI route for its OpenAPI schema."""
    return {s: {"model": TEIErrorResponse, "description": _MEANING[s]} for s in statuses}


TEI_ERRORS = tei_errors_doc(400, 401, 408, 413, 422, 424, 429, 500, 503)
TEI_TOKENIZER_ERRORS = tei_errors_doc(400, 401, 408, 413, 422, 500, 503)
# What a route other peers define too answers besides OpenAI's statuses for a body in TEI's
# form (``errors.TEI_FORMS``): /rerank's ``texts``, /tokenize's ``inputs``.
TEI_FORM_ERRORS = tei_errors_doc(422, 424)
TEI_TOKENIZER_FORM_ERRORS = tei_errors_doc(422)


def tei_inputs(request: Request, items: list, param: str = "inputs") -> list:
    """TEI's checks of a request's inputs before any model call, in TEI's order: 400 (Empty)
    for no inputs, 413 for more than --max-inputs-per-request, 400 (Empty) for an empty text
    or token list."""
    if not items:
        raise APIError(400, f"`{param}` cannot be empty", param=param, code=EMPTY)
    check_input_count(state_of(request).settings, len(items), param)
    for i, item in enumerate(items):
        if len(item) == 0:
            raise APIError(400, f"`{param}` {i} cannot be empty", param=param, code=EMPTY)
    return items


@router.post("/embed", response_model=list[list[float]], responses=TEI_ERRORS)
async def embed(body: TEIEmbedRequest, request: Request) -> Response:
    """One vector per input, as a JSON array of arrays (TEI names no model: the server's only
    embedding model answers)."""
    select_model(request, None, "embed")
    done = await run_model_outputs(
        request,
        tei_inputs(request, body.items()),
        param="inputs",
        dimensions=body.dimensions,
        normalize=body.normalize,
        long_inputs=long_inputs_of(body.truncate),
        truncation_side=body.side(),
        prompt_name=body.prompt_name,
    )
    if isinstance(done, Response):
        return done
    return await json_answer(
        request, lambda: encode_rows(done.outputs, "float"), values_in(done.outputs)
    )


@router.post("/embed_all", response_model=list[list[list[float]]], responses=TEI_ERRORS)
async def embed_all(body: TEIEmbedAllRequest, request: Request) -> Response:
    """Every token's embedding, special tokens included, per input ``[tokens, hidden]``: the
    model's last hidden states, neither pooled nor normalised."""
    select_model(request, None, "embed")
    done = await run_model_outputs(
        request,
        tei_inputs(request, body.items()),
        param="inputs",
        pooling="all",
        normalize=False,
        long_inputs=long_inputs_of(body.truncate),
        truncation_side=body.side(),
        prompt_name=body.prompt_name,
    )
    if isinstance(done, Response):
        return done
    return await json_answer(
        request, lambda: [m.tolist() for m in done.outputs], sum(m.size for m in done.outputs)
    )


@router.post("/similarity", response_model=list[float], responses=TEI_ERRORS)
async def similarity(body: TEISimilarityRequest, request: Request) -> Response:
    """The cosine similarity of ``inputs.source_sentence`` to each of ``inputs.sentences``, in
    their order (TEI's sentence-similarity)."""
    select_model(request, None, "embed")
    sentences = body.inputs.sentences
    if not sentences:
        raise APIError(
            400, "`inputs.sentences` cannot be empty", param="inputs.sentences", code=EMPTY
        )
    texts = tei_inputs(request, [body.inputs.source_sentence, *sentences])  # TEI counts both
    options = body.parameters
    done = await run_model_outputs(
        request,
        texts,
        param="inputs",
        normalize=True,  # cosines are dot products of unit vectors
        long_inputs=long_inputs_of(options.truncate) if options else None,
        truncation_side=options.truncation_direction.lower() if options else "right",
        prompt_name=options.prompt_name if options else None,
    )
    if isinstance(done, Response):
        return done
    vectors = done.matrix()
    cosines = (vectors[1:] @ vectors[0]).astype(np.float32)
    return await json_answer(request, lambda: cosines.tolist(), len(cosines))


@router.post("/decode", response_model=list[str], responses=TEI_TOKENIZER_ERRORS)
async def decode(body: TEIDecodeRequest, request: Request) -> Response:
    """The text of each list of token ids (the tokenizer of the server's first model, which
    /info describes), special tokens left out unless ``skip_special_tokens`` is false; one
    text per list, a list of one for one list."""
    state = state_of(request)
    settings = state.settings
    model = select_model(request, state.models.first.name)  # the model /info describes
    try:
        engine = model.front.engine
    except PipepoolError as exc:  # loading, or failed to start
        raise from_engine(exc) from None
    id_lists, batch = body.id_lists()
    if batch:
        tei_inputs(request, id_lists, "ids")  # "ids" names the batch, as TEI's errors do
    elif not id_lists[0]:
        raise APIError(400, "`input_ids` cannot be empty", param="ids", code=EMPTY)
    total = sum(map(len, id_lists))
    if total > settings.max_tokens_per_request:
        raise too_many_tokens(settings, total, "ids")
    tokenizer = engine.tokenizer
    vocab = tokenizer.vocab_size
    for i, ids in enumerate(id_lists):
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            where = f"ids {i}" if batch else "ids"
            raise APIError(
                400,
                f"{where} has {bad}, outside this model's vocabulary [0, {vocab})",
                param="ids",
                code="invalid_value",
            )
    texts = await model.front.offload(
        lambda: tokenizer.backend.decode_batch(
            id_lists, skip_special_tokens=body.skip_special_tokens
        ),
        size=total,
    )
    return await json_answer(request, lambda: list(texts), sum(map(len, texts)))


@router.get("/info", responses=tei_errors_doc(401, 500))
async def info(request: Request) -> dict:
    """What the model and the server's limits are, by TEI's names (``tei_info.py``)."""
    return tei_info(state_of(request))
