"""For operators: /health, /metrics (Prometheus) and /version."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from ... import __version__
from .. import metrics, protocol
from ..models import ServedModel
from ..store_faults import batch_store_health, store_metrics
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
    responses={503: _NOT_SERVING, **errors_doc(404, 500)},
)
async def health(
    request: Request,
    model: str | None = Query(None, description="one model's health only (by any of its names)"),
) -> JSONResponse:
    """200 ``ok`` once every model is loaded and every stage is alive. 503 otherwise, with the
    least healthy model's status: ``loading``, ``degraded`` (a stage died and the pipeline is
    being restarted: requests wait, and are answered once it is back; with replicas, a replica
    is restarting and the others take its work), ``dead`` or ``failed`` (the model failed for
    good), ``closed`` (shutting down). With replicas (``--dp``), ``replicas`` gives each one's
    state. A server of several models gives each one's status and replicas in ``models``;
    ``?model=NAME`` asks about one model alone (200 when it is ``ok``). With
    ``--api-server-count`` above 1, ``api_server`` says which front-end process answered.
    Once the Batch API was used, ``batch_store`` says whether its store writes (``ok``) or
    why not (``degraded``: disk full, I/O error); it does not change the status code, as
    online requests are served either way."""
    state = state_of(request)
    served = list(state.models) if model is None else [state.models.select(model)]
    each = {m.name: _health_of(m) for m in served}
    worst = max((h["status"] for h in each.values()), key=_SEVERITY.index)
    body: dict[str, object] = {"status": worst}
    if state.settings.api_server_count > 1:
        body["api_server"] = state.settings.api_server_index  # which process answered
    if len(served) == 1:
        body.update(each[served[0].name])  # one model: its own body
    else:
        body["models"] = each
    store = batch_store_health(state.settings.batch_state_dir)
    if store is not None:
        body["batch_store"] = store
    return JSONResponse(body, status_code=200 if worst == "ok" else 503)


# A model's health statuses, healthiest first: the server reports its least healthy model's.
_SEVERITY = ("ok", "loading", "degraded", "closed", "dead", "failed")


def _health_of(model: ServedModel) -> dict:
    owner = model.front.owner
    engine = owner.engine
    if engine is None:
        status = "failed" if owner.error is not None else "loading"
    else:
        status = engine.health
    body: dict[str, object] = {"status": status}
    replicas = engine.replica_status() if engine is not None else []
    if replicas:
        body["replicas"] = [r.state for r in replicas]
    return body


@router.get("/metrics", response_class=PlainTextResponse, responses=errors_doc(500))
async def prometheus(request: Request) -> PlainTextResponse:
    """Prometheus text format: each model's engine counters, KV blocks and queue (labelled
    ``model``), HTTP counters."""
    state = state_of(request)
    text = metrics.render(state.models, state.http)
    text += store_metrics(state.settings.batch_state_dir)
    return PlainTextResponse(text, media_type=metrics.CONTENT_TYPE)


@router.get("/version", response_model=protocol.VersionResponse, responses=READ_ERRORS)
async def version() -> dict:
    """The pipepool version serving (as vLLM's /version)."""
    return {"version": __version__}
