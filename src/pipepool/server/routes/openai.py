"""OpenAI's /v1/embeddings and /v1/models, and vLLM's /pooling (its /tokenize and /detokenize
are in ``tokens.py``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from fastapi import APIRouter, Request, Response

from ...loading.retrieval import OUTPUTS
from .. import protocol
from . import retrieval, scoring
from .shared import (
    ERRORS,
    READ_ERRORS,
    json_answer,
    model_of,
    run_model_outputs,
    select_model,
    state_of,
)

# (model name, outputs, tokens per input, encoding format, embed dtype) -> response body
Respond = Callable[[str, list[np.ndarray], list[int], str, protocol.EmbedDtype], dict]

router = APIRouter()


@router.post("/v1/embeddings", response_model=protocol.EmbeddingResponse, responses=ERRORS)
async def embeddings(body: protocol.EmbeddingRequest, request: Request) -> Response:
    """One vector per input (OpenAI's embeddings API); with ``outputs``, any of the dense
    vector, the sparse vector and the token vectors the model gives (``retrieval.py``)."""
    if body.outputs is not None:
        tasks = [retrieval.task_of(o) for o in body.outputs if o in OUTPUTS]
        select_model(request, body.model, *tasks)
        outputs = retrieval.check_model_outputs(request, body.outputs)
        if outputs != ("dense",):
            return await retrieval.embeddings(body, request, outputs)
    else:
        select_model(request, body.model, "embed")
    return await _run_model(
        request,
        body,
        protocol.embedding_response,
        dimensions=body.dimensions,
        normalize=body.normalize,
    )


@router.post("/pooling", response_model=protocol.PoolingResponse, responses=ERRORS)
async def pooling(body: protocol.PoolingRequest, request: Request) -> Response:
    """Token embeddings (ALL pooling): one [num_tokens, hidden] matrix per input; on a token
    classifier (``*ForTokenClassification``), each token's label probabilities instead
    (vLLM's token_classify), one [num_tokens, num_labels] matrix per input."""
    model = select_model(request, body.model, "embed", "classify_tokens")
    engine = model.front.owner.engine
    head = engine.deployment.classifier if engine is not None else None
    if head is not None and head.per_token:
        return await scoring.token_classify(body, request)
    return await _run_model(
        request, body, protocol.pooling_response, pooling="all", normalize=body.normalize
    )


async def _run_model(
    request: Request, body: protocol.InputsRequest, respond: Respond, **options
) -> Response:
    model = model_of(request)
    done = await run_model_outputs(
        request,
        body.inputs(),
        truncate_prompt_tokens=body.truncate_prompt_tokens,
        long_inputs=body.long_inputs,
        **options,
    )
    if isinstance(done, Response):
        return done
    name, fmt = model.names.response_name(body.model), body.encoding_format
    return await json_answer(
        request,
        lambda: respond(name, done.outputs, done.num_tokens, fmt, body.embed_dtype),
        sum(out.size for out in done.outputs),
    )


@router.get("/v1/models", response_model=protocol.ModelList, responses=READ_ERRORS)
async def models(request: Request) -> dict:
    """Every name this server answers to, a card per name (a model folder's path is accepted
    but not listed); each card says which model it names (``root``: the name responses carry)
    and, once that model has loaded, what it does (``tasks``) and its longest input."""
    state = state_of(request)
    cards = []
    for model in state.models:
        engine = model.front.owner.engine
        tasks = model.tasks()
        for name in model.names.shown:
            card = {
                "id": name,
                "object": "model",
                "created": state.started,
                "owned_by": "pipepool",
                "root": model.name,
            }
            if engine is not None:
                card["max_model_len"] = engine.deployment.max_model_len
            if tasks is not None:
                card["tasks"] = list(tasks)
            cards.append(card)
    return {"object": "list", "data": cards}
