"""For operators: /health, /metrics (Prometheus) and /version."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from ... import __version__
from .. import health, metrics, protocol
from ..store_faults import store_metrics
from .shared import READ_ERRORS, errors_doc, state_of

router = APIRouter()

_NOT_SERVING = {
    "model": health.HealthResponse,
    "description": "No model serves: the status is the least healthy model's.",
}


@router.get(
    "/health",
    response_model=health.HealthResponse,
    response_model_exclude_none=True,
    responses={503: _NOT_SERVING, **errors_doc(404, 500)},
)
async def server_health(
    request: Request,
    model: str | None = Query(None, description="one model's health only (by any of its names)"),
) -> JSONResponse:
    """200 while any model serves: ``ok`` when every model serves and every other component
    (the batch store) is ok, else ``degraded``, naming what is not ok. 503 when no model
    serves, with the least healthy model's status: ``loading``, ``degraded`` (a stage died and
    the pipeline is being restarted: requests wait, and are answered once it is back; with
    replicas, a replica is restarting and the others take its work), ``dead`` or ``failed``
    (the model failed for good), ``closed`` (shutting down). With replicas (``--dp``),
    ``replicas`` gives each one's state. A server of several models gives each one's status and
    replicas in ``models``; ``components`` names the components not ok, with why.
    ``?model=NAME`` asks about one model alone (200 when it serves), as
    ``/v2/models/NAME/ready`` does. With ``--api-server-count`` above 1, ``api_server`` says
    which front-end process answered."""
    state = state_of(request)
    if model is None:
        code, body = health.server_health(state.models, state.checks.states())
    else:
        code, body = health.server_health([state.models.select(model)], {})
    if state.settings.api_server_count > 1:
        body.api_server = state.settings.api_server_index  # which process answered
    return JSONResponse(body.model_dump(exclude_none=True), status_code=code)


@router.get(
    "/v2/models/{model:path}/ready",
    response_model=health.ReadyResponse,
    responses={503: {"model": health.ReadyResponse, "description": "The model does not serve "
               "now (loading, restarting, failed): its status says which."},
               **errors_doc(404, 500)},
)  # fmt: skip
async def model_ready(request: Request, model: str) -> JSONResponse:
    """One model's readiness, for load balancers and Kubernetes probes (KServe's Open Inference
    Protocol route): 200 ``ready`` while the model serves, 503 while it loads or restarts or
    once it failed; 404 for a name no model has. Open without the API key, as /health."""
    served = state_of(request).models.select(model)
    code, body = health.model_ready(served, model)
    return JSONResponse(body.model_dump(), status_code=code)


@router.get("/metrics", response_class=PlainTextResponse, responses=errors_doc(500))
async def prometheus(request: Request) -> PlainTextResponse:
    """Prometheus text format: each model's engine counters, KV blocks and queue (labelled
    ``model``), HTTP counters, and whether each other component (the batch store) is ok."""
    state = state_of(request)
    text = metrics.render(state.models, state.http, state.checks.states())
    text += store_metrics(state.settings.batch_state_dir)
    return PlainTextResponse(text, media_type=metrics.CONTENT_TYPE)


@router.get("/version", response_model=protocol.VersionResponse, responses=READ_ERRORS)
async def version() -> dict:
    """The pipepool version serving (as vLLM's /version)."""
    return {"version": __version__}
