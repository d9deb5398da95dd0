"""The HTTP app: OpenAI's /v1/embeddings and /v1/models, vLLM's /pooling and /tokenize
(``routes/openai.py``), TEI's /embed, /info and /tokenize (``routes/tei.py``), a classifier's
/rerank, /score and /classify (``routes/scoring.py``), /health and /metrics for operators
(``routes/operators.py``). API docs at /docs, served from here (``docs.py``: no CDN, so they
load offline)."""

from __future__ import annotations

from fastapi import FastAPI

from .. import __version__
from . import docs
from .errors import install_handlers
from .front import AsyncEngine
from .guards import GuardMiddleware
from .metrics import MetricsMiddleware
from .routes import openai, operators, scoring, tei
from .routes.shared import ServerState
from .settings import ServerSettings

__all__ = ["ServerState", "build_app"]


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
    app.include_router(openai.router)
    app.include_router(operators.router)
    app.include_router(tei.router)
    app.include_router(scoring.router)
    app.include_router(docs.router)
    return app
