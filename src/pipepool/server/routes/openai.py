"""OpenAI's /v1/embeddings and /v1/models (vLLM's /pooling is in ``pooling.py``, its /tokenize
and /detokenize in ``tokens.py``)."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request, Response

from .. import protocol
from ..fast_route import FastBodyRoute
from ..model_cards import CardQuery, model_card
from ..models import ServedModel
from . import embedding_request
from .shared import ERRORS, ServerState, errors_doc, run_engine, state_of

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
    ``late_chunking``, the chunks of one document (``late_chunking.py``); with ``messages``
    (vLLM's chat form), one input (``chat_embeddings.py``). Prepared, run and answered in turn
    (``embedding_request.py``)."""
    work = await embedding_request.prepare(request, body)
    done = await run_engine(request, work)
    if isinstance(done, Response):  # the client left
        return done
    return await embedding_request.answer(request, body, done)


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
