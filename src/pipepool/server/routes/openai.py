"""OpenAI's /v1/embeddings and /v1/models (vLLM's /pooling is in ``pooling.py``, its /tokenize
and /detokenize in ``tokens.py``)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from ...loading.retrieval import OUTPUTS
from .. import protocol
from ..errors import APIError
from ..front import Encoded
from ..pooling_protocol import answer_head
from . import retrieval
from .late_chunking import late_chunked
from .shared import (
    ERRORS,
    READ_ERRORS,
    binary_answer,
    json_answer,
    model_of,
    run_model_outputs,
    select_model,
    state_of,
)

router = APIRouter()

# The answer's media types: OpenAI's JSON, or vLLM's bytes (encoding_format bytes, bytes_only).
VECTOR_ANSWERS = {
    "content": {
        "application/json": {},
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
    }
}


@router.post(
    "/v1/embeddings",
    response_model=protocol.EmbeddingResponse,
    responses={**ERRORS, 200: VECTOR_ANSWERS},
)
async def embeddings(body: protocol.EmbeddingRequest, request: Request) -> Response:
    """One vector per input (OpenAI's embeddings API); with ``outputs``, any of the dense
    vector, the sparse vector and the token vectors the model gives (``retrieval.py``); with
    ``late_chunking``, the chunks of one document (``late_chunking.py``)."""
    if body.late_chunking and body.outputs not in (None, ["dense"]):
        raise APIError(
            400,
            "late_chunking gives dense vectors only: ask for sparse or multi_vector outputs "
            "without it",
            param="late_chunking",
            code="invalid_value",
        )
    if body.outputs is not None:
        tasks = [retrieval.task_of(o) for o in body.outputs if o in OUTPUTS]
        select_model(request, body.model, *tasks)
        outputs = retrieval.check_model_outputs(request, body.outputs)
        if outputs != ("dense",):
            if body.wire.binary:
                raise APIError(
                    400,
                    f"encoding_format {body.encoding_format} carries dense vectors only; ask "
                    f"for {', '.join(outputs)} with encoding_format float or base64",
                    param="encoding_format",
                    code="invalid_value",
                )
            return await retrieval.embeddings(body, request, outputs)
    else:
        select_model(request, body.model, "embed")
    answered: Encoded | Response
    if body.late_chunking:
        answered = await late_chunked(request, body)
    else:
        answered = await run_model_outputs(
            request,
            body.inputs(),
            truncate_prompt_tokens=body.truncate_prompt_tokens,
            truncation_side=body.truncation_side or "right",
            long_inputs=body.long_inputs,
            add_special_tokens=body.add_special_tokens,
            dimensions=body.dimensions,
            normalize=body.normalized,
        )
    if isinstance(answered, Response):
        return answered
    done = answered
    name, wire = model_of(request).names.response_name(body.model), body.wire
    if wire.binary:
        head = {**answer_head("embd"), "model": name}
        return await binary_answer(request, done.outputs, wire, head, done.num_tokens)
    return await json_answer(
        request,
        lambda: protocol.embedding_response(name, done.outputs, done.num_tokens, wire),
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
                card["max_model_len"] = engine.info.max_model_len
            if tasks is not None:
                card["tasks"] = list(tasks)
            cards.append(card)
    return {"object": "list", "data": cards}
