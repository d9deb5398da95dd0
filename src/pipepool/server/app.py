"""The routes: OpenAI's /v1/embeddings and /v1/models, vLLM's /pooling and /tokenize, TEI's
/embed, /info and /tokenize (``tei.py``), a classifier's /rerank, /score and /classify
(``scoring.py``), and /health and /metrics for operators. API docs at /docs, served from here
(``docs.py``: no CDN, so they load offline)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from .. import __version__
from ..errors import PipepoolError
from . import docs, metrics, protocol, scoring, tei
from .errors import (
    RATE_LIMIT,
    SERVER,
    APIError,
    from_engine,
    install_handlers,
    model_not_found,
)
from .front import AsyncEngine, Encoded, QueueFullError
from .guards import GuardMiddleware
from .metrics import HttpMetrics, MetricsMiddleware
from .settings import ServerSettings

T = TypeVar("T")
# (model name, outputs, tokens per input, encoding format) -> response body
Respond = Callable[[str, list[np.ndarray], list[int], str], dict]

# Status for a request whose client went away: nobody reads it, the access log and the
# metrics do (nginx's "client closed request").
CLIENT_CLOSED = 499

_ERRORS = {
    status: {"model": protocol.ErrorResponse} for status in (400, 401, 404, 413, 429, 500, 503)
}

router = APIRouter()


@dataclass
class ServerState:
    """What the routes share; one per app, at ``app.state.pipepool``."""

    settings: ServerSettings
    front: AsyncEngine
    http: HttpMetrics = field(default_factory=HttpMetrics)
    started: int = field(default_factory=lambda: int(time.time()))


def build_app(settings: ServerSettings, front: AsyncEngine) -> FastAPI:
    state = ServerState(settings, front)
    app = FastAPI(
        title="pipepool",
        version=__version__,
        description="OpenAI-compatible embeddings from a pipeline-parallel pooling engine.",
        docs_url=None,  # FastAPI's page loads its scripts from a CDN: blank offline
        redoc_url=None,
    )
    app.state.pipepool = state
    install_handlers(app, state.http.on_error)
    # Added last = runs first: metrics count what the guards turn away.
    app.add_middleware(
        GuardMiddleware,
        api_key=settings.api_key,
        max_body_bytes=settings.max_body_bytes,
        on_error=state.http.on_error,
    )
    app.add_middleware(MetricsMiddleware, metrics=state.http)
    app.include_router(router)
    app.include_router(tei.router)
    app.include_router(scoring.router)
    app.include_router(docs.router)
    return app


def _state(request: Request) -> ServerState:
    return request.app.state.pipepool


# -- the model routes ---------------------------------------------------------------------


@router.post("/v1/embeddings", response_model=protocol.EmbeddingResponse, responses=_ERRORS)
async def embeddings(body: protocol.EmbeddingRequest, request: Request) -> Response:
    """One vector per input (OpenAI's embeddings API)."""
    return await _run_model(
        request,
        body,
        protocol.embedding_response,
        dimensions=body.dimensions,
        normalize=body.normalize,
    )


@router.post("/pooling", response_model=protocol.PoolingResponse, responses=_ERRORS)
async def pooling(body: protocol.PoolingRequest, request: Request) -> Response:
    """Token embeddings (ALL pooling): one [num_tokens, hidden] matrix per input."""
    return await _run_model(
        request, body, protocol.pooling_response, pooling="all", normalize=body.normalize
    )


@router.post("/tokenize", response_model=protocol.TokenizeResponse, responses=_ERRORS)
async def tokenize(body: protocol.TokenizeRequest, request: Request) -> dict | JSONResponse:
    """Token ids of a text, special tokens included, as the model routes see them."""
    state = _state(request)
    _check_model(state, body.model)
    if body.inputs is not None:
        return JSONResponse(await tei.tokenize(state, body.inputs))  # TEI's shape, not ours
    try:
        ids = await state.front.tokenize(body.text)
    except PipepoolError as exc:
        raise from_engine(exc) from None
    max_len = state.front.engine.deployment.max_model_len
    return {"tokens": ids.tolist(), "count": len(ids), "max_model_len": max_len}


async def _run_model(
    request: Request, body: protocol.InputsRequest, respond: Respond, **options
) -> Response:
    state = _state(request)
    _check_model(state, body.model)
    done = await _run_model_outputs(
        request,
        body.inputs(),
        truncate_prompt_tokens=body.truncate_prompt_tokens,
        long_inputs=body.long_inputs,
        **options,
    )
    if isinstance(done, Response):
        return done
    name, fmt = body.model or state.settings.model_name, body.encoding_format
    # Serializing thousands of floats takes a while: keep it off the event loop.
    text = await state.front.offload(
        lambda: json.dumps(
            respond(name, done.outputs, done.num_tokens, fmt), separators=(",", ":")
        ),
        size=sum(out.size for out in done.outputs),
    )
    return Response(text, media_type="application/json")


async def _run_model_outputs(request: Request, inputs: list, **options) -> Encoded | Response:
    """Checks, engine call, outputs; a bare Response (499) if the client left meanwhile."""
    state = _state(request)
    check_inputs(state, inputs)
    limit = state.settings.max_inputs_per_request
    if len(inputs) > limit:
        raise APIError(
            400,
            f"input has {len(inputs)} items; this server takes at most {limit} per request",
            param="input",
            code="too_many_inputs",
        )
    try:
        return await _unless_client_leaves(request, state.front.encode(inputs, **options))
    except _ClientGone:
        return Response(status_code=CLIENT_CLOSED)


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name not in state.settings.model_names:
        raise model_not_found(name, state.settings.model_names)


def check_inputs(state: ServerState, inputs: list) -> None:
    """400 for an empty input list, and for token ids unless the server was told to take
    them (``--allow-token-ids``): ids of another tokenizer would give wrong vectors silently."""
    if not inputs:
        raise APIError(400, "input is empty: send at least one text", param="input")
    if isinstance(inputs[0], str) or state.settings.allow_token_ids:
        return
    raise APIError(
        400,
        "this server takes text, not token ids: ids are read as this model's own token ids, "
        "and ids from another tokenizer give wrong vectors without any error. LangChain's "
        "OpenAIEmbeddings sends OpenAI tokenizer ids unless you pass "
        "check_embedding_ctx_length=False; set that (or send text). If these are ids of this "
        "model's tokenizer, start the server with --allow-token-ids.",
        param="input",
        code="token_ids_not_allowed",
    )


class _ClientGone(Exception):
    pass


async def _unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """Await the engine; if the client disconnects first, cancel (which aborts the engine
    requests and frees their KV blocks) and raise _ClientGone. If the server stops waiting
    first (shutdown timeout), cancel and answer 503."""
    abandoned = _state(request).front.abandoned
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    giving_up = asyncio.ensure_future(abandoned.wait())
    try:
        await asyncio.wait({task, watcher, giving_up}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # cancelled from outside (uvicorn's own last resort)
        task.cancel()
        raise
    finally:
        watcher.cancel()
        giving_up.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # let it abort before we return
        if abandoned.is_set():
            raise APIError(
                503,
                "the server is shutting down and stopped waiting for this request; retry it",
                type=SERVER,
                code="shutting_down",
            )
        raise _ClientGone
    try:
        return task.result()
    except QueueFullError as exc:
        raise APIError(
            429, str(exc), type=RATE_LIMIT, code="queue_full", headers={"Retry-After": "1"}
        ) from None
    except PipepoolError as exc:
        raise from_engine(exc) from None


async def _disconnected(request: Request) -> None:
    # The body was read already, so the next message is the disconnect (uvicorn sends it
    # when the connection drops; it never comes if the response completes first).
    while (await request.receive())["type"] != "http.disconnect":
        pass


# -- for operators ------------------------------------------------------------------------


@router.get("/v1/models")
async def models(request: Request) -> dict:
    state = _state(request)
    engine = state.front.owner.engine
    cards = []
    for name in state.settings.model_names:
        card = {"id": name, "object": "model", "created": state.started, "owned_by": "pipepool"}
        if engine is not None:
            card["max_model_len"] = engine.deployment.max_model_len
        cards.append(card)
    return {"object": "list", "data": cards}


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 ``ok`` once the model is loaded and every stage is alive. 503 otherwise: ``loading``,
    ``degraded`` (a stage died and the pipeline is being restarted: requests wait, and are
    answered once it is back; with replicas, a replica is restarting and the others take its
    work), ``dead`` or ``failed`` (the server is about to exit non-zero), ``closed`` (shutting
    down). With replicas (``--dp``) the body also lists each one's state; with
    ``--api-server-count`` above 1, which front-end process answered."""
    state = _state(request)
    owner = state.front.owner
    engine = owner.engine
    if engine is None:
        status = "failed" if owner.error is not None else "loading"
    else:
        status = engine.health
    body = {"status": status}
    if state.settings.api_server_count > 1:
        body["api_server"] = state.settings.api_server_index  # which process answered
    if engine is not None and hasattr(engine, "replica_status"):
        body["replicas"] = [r.state for r in engine.replica_status()]
    return JSONResponse(body, status_code=200 if status == "ok" else 503)


@router.get("/metrics", response_class=PlainTextResponse)
async def prometheus(request: Request) -> PlainTextResponse:
    """Prometheus text format: engine counters, KV blocks, HTTP counters."""
    state = _state(request)
    text = metrics.render(state.front.owner.engine, state.front, state.http)
    return PlainTextResponse(text, media_type=metrics.CONTENT_TYPE)
