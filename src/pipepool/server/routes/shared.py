"""What every route shares: the server's state, the choice of model, and the one path of a
model call (its work made ready within the limits by ``limits.py``, then the engine queue, the
engine's errors as 4xx/5xx, a 499 when the client leaves meanwhile)."""

from __future__ import annotations

import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request, Response

from ...errors import PipepoolError
from .. import protocol
from ..awaiting import GivenUp
from ..errors import RATE_LIMIT, SERVER, APIError, from_engine, retry_later_headers
from ..front import Encoded, EngineCall, QueueFullError
from ..health import HealthChecks
from ..limits import embedding_call
from ..metrics import HttpMetrics
from ..models import ServedModel, ServedModels
from ..settings import ServerSettings
from .page_retrievers import refuse_page_retriever

T = TypeVar("T")

# Status for a request whose client went away: nobody reads it, the access log and the
# metrics do (nginx's "client closed request").
CLIENT_CLOSED = 499

# What each error status means, for the OpenAPI schema.
_MEANING = {
    400: "Invalid request: a bad or unknown field, a lone surrogate, too many inputs or tokens "
    "(the message names the limit and its flag); no model named where several could answer; "
    "outputs or a /pooling task the model does not give (the message names those it gives).",
    401: "Missing or wrong API key (a server started with --api-key).",
    404: "Unknown model name, or a route the model cannot serve (an embedding model's /rerank, "
    "a classifier's /v1/embeddings): OpenAI's answer to a model used on an endpoint it does "
    "not serve.",
    408: "The request body did not arrive within --body-timeout.",
    413: "Request body larger than --max-body-bytes.",
    429: "The model's queue is full (--max-queued-requests); retry after Retry-After seconds.",
    500: "Internal error (the server's log has the details).",
    503: "The model is loading or restarting, its engine has failed, or the server is shutting "
    "down.",
}


def errors_doc(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The error answers of a route for its OpenAPI schema (FastAPI's ``responses=``)."""
    return {
        status: {"model": protocol.ErrorResponse, "description": _MEANING[status]}
        for status in statuses
    }


# The error answers of the routes that run the model, and of those that only tokenise.
ERRORS = errors_doc(400, 401, 404, 408, 413, 429, 500, 503)
TOKENIZER_ERRORS = errors_doc(400, 401, 404, 408, 413, 500, 503)
# A route that reads no body: only the API key can turn it away.
READ_ERRORS = errors_doc(401, 500)


@dataclass
class ServerState:
    """What the routes share; one per app, at ``app.state.pipepool``."""

    settings: ServerSettings
    models: ServedModels
    http: HttpMetrics
    started: int = field(default_factory=lambda: int(time.time()))
    # The components other than the models that /health and /metrics report (health.py).
    checks: HealthChecks = field(default_factory=HealthChecks)


def state_of(request: Request) -> ServerState:
    return request.app.state.pipepool


def select_model(request: Request, name: str | None, *tasks: str) -> ServedModel:
    """The model that answers this request (``ServedModels.select``: the one ``name`` names,
    or with no name the only one doing one of ``tasks``), kept with the request for the rest
    of its way (``model_of``) and for the metrics, which count requests by model."""
    model = state_of(request).models.select(name, tasks)
    request.state.pipepool_model = model
    return model


def model_of(request: Request) -> ServedModel:
    """The model ``select_model`` chose for this request."""
    return request.state.pipepool_model


async def run_model_outputs(
    request: Request,
    inputs: list,
    *,
    param: str = "input",
    add_special_tokens: bool = True,
    **options,
) -> Encoded | Response:
    """Checks, engine call (``Engine.submit(inputs, **options)`` within the server's limits:
    ``limits.embedding_call``), outputs; a bare Response (499) if the client left meanwhile.
    ``param``: the request field that holds the inputs, which the errors name.
    ``add_special_tokens`` false: texts go to the model without the special tokens it adds
    (``limits.plain_token_ids``). 404 for a model that does not embed."""
    state, model = state_of(request), model_of(request)
    per_token = options.get("pooling") == "all"
    answers = "a text's hidden state per token" if per_token else "one vector per input"
    refuse_page_retriever(model, f"{request.url.path} answers {answers}")
    check_task(model, "embed")
    work = embedding_call(
        state.settings,
        model.front,
        inputs,
        options,
        param,
        add_special_tokens=add_special_tokens,
    )
    return await run_engine(request, work)


async def run_engine(request: Request, work: EngineCall) -> Any:
    """``work`` on the request's model (``AsyncEngine.perform``): its outputs, the engine's
    errors as 4xx/5xx (``unless_client_leaves``), or a bare Response (499) if the client left
    meanwhile. A refusal naming ``input i`` names the request's own field where ``work`` says
    how (``EngineCall.renamed``)."""
    try:
        return await unless_client_leaves(request, model_of(request).front.perform(work))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    except APIError as exc:
        if work.renamed is None:
            raise
        raise work.renamed(exc) from None


# Each task (``api.routing.TASKS``) as a 404 names it: what it gives, and what model gives it.
_TASKS = {
    "embed": ("embeddings", "an embedding model"),
    "sparse": ("sparse outputs", "a SPLADE or BGE-M3 model"),
    "multi_vector": ("multi-vector outputs", "a ColBERT or BGE-M3 model"),
    "score": ("scores of pairs", "a cross-encoder or reranker with one label, or a ColBERT or "
              "BGE-M3 model"),
    "classify": ("classification", "a sequence classifier (*ForSequenceClassification)"),
    "classify_tokens": ("token classification", "a token classifier (*ForTokenClassification)"),
}  # fmt: skip
_TASKS["rerank"] = ("reranking", _TASKS["score"][1])


def check_task(model: ServedModel, task: str) -> None:
    """404 where ``model`` cannot do ``task`` (one of ``api.routing.TASKS``), or is not offered
    for it, as OpenAI answers a model used on an endpoint it does not serve; 503 while the
    model loads."""
    try:
        info = model.front.engine.info
    except PipepoolError as exc:  # loading, or failed to start
        raise from_engine(exc) from None
    tasks = model.tasks() or ()
    if task not in tasks:
        what, needs = _TASKS[task]
        refuse_page_retriever(model, f"it does not give {what}")
        does = ", ".join(tasks) or "nothing"
        if task in info.tasks:
            message = f"model {model.name} is not offered for {what} here; what it does: {does}"
        else:
            message = (
                f"model {model.name} ({info.architecture}) does not give {what}: "
                f"that needs {needs}. What it does: {does}"
            )
        raise APIError(
            404,
            message,
            param="model",
            code="unsupported_task",
        )


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """Await the engine; if the client disconnects first, cancel (which aborts the engine
    requests and frees their KV blocks) and raise ClientGone. If the server stops waiting
    first (shutdown timeout), cancel and answer 503 (``awaiting.Awaiting``)."""
    try:
        return await model_of(request).front.awaiting.result(work, request.receive)
    except GivenUp as gone:
        if not gone.abandoned:
            raise ClientGone from None
        raise APIError(
            503,
            "the server is shutting down and stopped waiting for this request; retry it",
            type=SERVER,
            code="shutting_down",
        ) from None
    except QueueFullError as exc:
        raise APIError(
            429, str(exc), type=RATE_LIMIT, code="queue_full", headers=retry_later_headers()
        ) from None
    except PipepoolError as exc:
        raise from_engine(exc) from None
