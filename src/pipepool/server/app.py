"""The HTTP app: OpenAI's /v1/embeddings and /v1/models (``routes/openai.py``), vLLM's /pooling
(``routes/pooling.py``), /tokenize (vLLM's and TEI's forms) and /detokenize
(``routes/tokens.py``), TEI's /embed and /info (``routes/tei.py``), sparse and multi-vector
outputs: TEI's /embed_sparse and the ``outputs`` of /v1/embeddings (``routes/retrieval.py``),
Cohere's /v2/embed (``routes/cohere.py``), /rerank, /score and /classify of a classifier, and
/rerank and /score of a ColBERT or BGE-M3 model (``routes/scoring.py``), /health, /metrics and
/version for operators (``routes/operators.py``), OpenAI's Files and Batches APIs
(``routes/files.py``, ``routes/batches.py``; ``batch_runner.py`` runs the batches). API docs
at /docs, served from here (``docs.py``: no CDN, so they load offline)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from .. import __version__
from . import docs
from .direct_routes import DirectRoutes
from .errors import install_handlers
from .front_door import FrontDoor
from .metrics import HttpMetrics
from .models import ServedModels
from .online_gate import OnlineRequests
from .openapi import bound_by_server
from .refusal_pacing import RefusalPacing
from .routes import (
    batches,
    cohere,
    files,
    openai,
    operators,
    pooling,
    retrieval,
    scoring,
    tei,
    tei_predict,
    tei_root,
    tokens,
)
from .routes.shared import ServerState
from .settings import ServerSettings
from .store_faults import store_check

__all__ = ["ServerState", "build_app"]

ROUTERS = (
    openai.router,
    pooling.router,
    tokens.router,
    operators.router,
    tei.router,
    tei_predict.router,
    tei_root.router,
    retrieval.router,
    cohere.router,
    scoring.router,
    files.router,
    batches.router,
    docs.router,
)


def build_app(settings: ServerSettings, models: ServedModels) -> FastAPI:
    """The app of one front-end process serving ``models``: routes, error bodies, guards,
    metrics, access log."""
    app = FastAPI(
        title="pipepool",
        version=__version__,
        description="OpenAI-compatible embeddings from a pipeline-parallel pooling engine.",
        docs_url=None,  # FastAPI's page loads its scripts from a CDN: blank offline
        redoc_url=None,
    )
    for router in ROUTERS:
        app.include_router(router)
    paths = {getattr(route, "path", "") for router in ROUTERS for route in router.routes}
    http = HttpMetrics(frozenset(paths - {""}))
    state = ServerState(settings, models, http)
    state.checks.add("batch_store", store_check(settings.batch_state_dir))
    app.state.pipepool = state
    install_handlers(app, http.on_error)
    # Innermost: the fast embedding routes' POSTs, past the router (``direct_routes.py``).
    routes = [route for router in ROUTERS for route in router.routes]
    app.add_middleware(DirectRoutes, routes=routes, exception_handlers=app.exception_handlers)
    # Inside the front door (added before it): refusals of large bodies, held (issue 57).
    app.add_middleware(RefusalPacing)
    # Added last = runs first. One layer: metrics, timing, client turns and the guards.
    app.add_middleware(FrontDoor, settings=settings, metrics=http)
    # Outermost: a batch's host work waits from the moment an online request arrives.
    app.add_middleware(OnlineRequests)
    _schema_as_answered(app, settings, models)
    return app


def _schema_as_answered(app: FastAPI, settings: ServerSettings, models: ServedModels) -> None:
    """The OpenAPI schema without FastAPI's 422 answers: a request that fails validation is
    answered 400 with an OpenAI error body (422 with TEI's on TEI's routes: ``errors.py``),
    which each route lists; with the
    bounds of this server's settings and models (``openapi.py``)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        schema = build()  # FastAPI's, cached on the app: stripped once
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                responses = operation.get("responses", {})
                if "HTTPValidationError" in str(responses.get("422")):  # FastAPI's, not TEI's
                    responses.pop("422")
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        bound_by_server(schema, settings, models)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
