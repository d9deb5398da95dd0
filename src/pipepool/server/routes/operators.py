"""For operators: /health, /metrics (Prometheus) and /version."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from ... import __version__
from .. import metrics, protocol
from .shared import READ_ERRORS, errors_doc, state_of

router = APIRouter()

_NOT_SERVING = {
    "model": protocol.HealthResponse,
    "description": "Not serving at full health: the status says why.",
}


@router.get(
    "/health",
    response_model=protocol.HealthResponse,
    response_model_exclude_none=True,
    responses={503: _NOT_SERVING, **errors_doc(500)},
)
async def health(request: Request) -> JSONResponse:
    """200 ``ok`` once the model is loaded and every stage is alive. 503 otherwise: ``loading``,
    ``degraded`` (a stage died and the pipeline is being restarted: requests wait, and are
    answered once it is back; with replicas, a replica is restarting and the others take its
    work), ``dead`` or ``failed`` (the server is about to exit non-zero), ``closed`` (shutting
    down). With replicas (``--dp``) the body also lists each one's state; with
    ``--api-server-count`` above 1, which front-end process answered."""
    state = state_of(request)
    owner = state.front.owner
    engine = owner.engine
    if engine is None:
        status = "failed" if owner.error is not None else "loading"
    else:
        status = engine.health
    body: dict[str, object] = {"status": status}
    if state.settings.api_server_count > 1:
        body["api_server"] = state.settings.api_server_index  # which process answered
    replicas = engine.replica_status() if engine is not None else []
    if replicas:
        body["replicas"] = [r.state for r in replicas]
    return JSONResponse(body, status_code=200 if status == "ok" else 503)


@router.get("/metrics", response_class=PlainTextResponse, responses=errors_doc(500))
async def prometheus(request: Request) -> PlainTextResponse:
    """Prometheus text format: engine counters, KV blocks, HTTP counters."""
    state = state_of(request)
    text = metrics.render(state.front.owner.engine, state.front, state.http)
    return PlainTextResponse(text, media_type=metrics.CONTENT_TYPE)


@router.get("/version", response_model=protocol.VersionResponse, responses=READ_ERRORS)
async def version() -> dict:
    """The pipepool version serving (as vLLM's /version)."""
    return {"version": __version__}
