"""OpenAI's /v1/embeddings and /v1/models (vLLM's /pooling is in ``pooling.py``, its /tokenize
and /detokenize in ``tokens.py``)."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request, Response

from ...loading.retrieval import OUTPUTS
from .. import protocol
from ..errors import APIError
from ..fast_route import FastBodyRoute
from ..front import Encoded
from ..model_cards import CardQuery, model_card
from ..models import ServedModel
from ..pooling_protocol import answer_head
from . import retrieval
from .late_chunking import late_chunked
from .shared import (
    ERRORS,
    ServerState,
    binary_answer,
    errors_doc,
    json_answer,
    model_of,
    run_model_outputs,
    select_model,
    state_of,
)

router = APIRouter(route_class=FastBodyRoute)

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


@router.get(
    "/v1/models",
    response_model=protocol.ModelList,
    response_model_exclude_none=True,  # Cohere's document types its fields as never null
    responses=errors_doc(400, 401, 500),
)
async def models(
    request: Request,
    endpoint: str | None = Query(None, description="Cohere's filter: models for this endpoint."),
    default_only: bool = Query(False, description="Cohere's filter: the endpoint's default only."),
    page_size: float | None = Query(None, description="Cohere's page size (1-1000)."),
    page_token: str | None = Query(None, description="Cohere's next_page_token."),
) -> dict:
    """Every name this server answers to, a card per name (a model folder's path is accepted
    but not listed); each card says which model it names (``root``: the name responses carry)
    and, once that model has loaded, what it does (``tasks``) and its longest input. Read by
    OpenAI's and Cohere's clients alike (``model_cards.py``)."""
    query = CardQuery(endpoint, default_only, page_size, page_token)
    query.check()
    state = state_of(request)
    cards = [_card(state, name, model) for model in state.models for name in model.names.shown]
    page, next_token = query.page([c for c in cards if query.keeps(c)])
    return {"object": "list", "data": page, "models": page, "next_page_token": next_token}


@router.get(
    "/v1/models/{model:path}",
    response_model=protocol.ModelCard,
    response_model_exclude_none=True,
    responses=errors_doc(401, 404, 500),
)
async def model(request: Request, model: str) -> dict:
    """The card of one name (OpenAI's ``models.retrieve``, Cohere's ``models.get``): any name
    the server answers to, a folder path included (its card carries the first name); 404
    ``model_not_found`` for any other."""
    state = state_of(request)
    served = state.models.select(model)
    name = model if model in served.names.shown else served.name
    return _card(state, name, served)


def _card(state: ServerState, name: str, model: ServedModel) -> dict:
    engine = model.front.owner.engine
    max_len = engine.info.max_model_len if engine is not None else None
    return model_card(name, model, state.models, state.started, max_len)
