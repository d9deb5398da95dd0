"""What every route shares: the server's state, the choice of model and the input checks, and
the one path of a model call (limits, the engine queue, the engine's errors as 4xx/5xx, a 499
when the client leaves meanwhile)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from fastapi import Request, Response

from ...api.engine import Engine
from ...errors import PipepoolError
from ...intake.inputs import valid_texts
from .. import protocol
from ..encoding import Vectors, Wire, binary_response, json_bytes
from ..errors import RATE_LIMIT, SERVER, APIError, from_engine, retry_later_headers
from ..front import AnySubmission, Encoded, QueueFullError
from ..health import HealthChecks
from ..limits import bounded_embedding, check_input_count, check_text_lengths
from ..metrics import HttpMetrics
from ..models import ServedModel, ServedModels
from ..settings import ServerSettings

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
    """Checks, engine call (``Engine.submit(inputs, **options)`` within the server's limits),
    outputs; a bare Response (499) if the client left meanwhile. ``param``: the request field
    that holds the inputs, which the errors name. ``add_special_tokens`` false: texts go to
    the model without the special tokens it adds (``plain_token_ids``). 404 for a model that
    does not embed."""
    state, model = state_of(request), model_of(request)
    check_task(model, "embed")
    check_inputs(state, inputs, param)
    check_input_count(state.settings, len(inputs), param)
    if add_special_tokens or not isinstance(inputs[0], str):
        submit = bounded_embedding(state.settings, inputs, options, param)
    else:
        check_text_lengths(state.settings, model.front.engine.info, inputs, param)
        submit = _without_special_tokens(state.settings, inputs, options, param)
    try:
        return await unless_client_leaves(request, model.front.run(len(inputs), submit, inputs))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)


def _without_special_tokens(
    settings: ServerSettings, texts: list[str], options: dict[str, Any], param: str
) -> Callable[[Engine], AnySubmission]:
    """``bounded_embedding`` of the texts' ``plain_token_ids``, tokenised where it runs."""

    def submit(engine: Engine) -> AnySubmission:
        ids = plain_token_ids(engine, texts, param)
        return bounded_embedding(settings, ids, options, param)(engine)

    return submit


def plain_token_ids(engine: Engine, texts: list[str], param: str = "input") -> list[np.ndarray]:
    """Token ids of texts without the special tokens the model adds ([CLS], [SEP], BOS...):
    vLLM's ``add_special_tokens: false``. The model's default prompt stays in front of each:
    it is text the model expects, not a special token. Texts checked as the engine checks
    them (empty, lone surrogates), errors naming ``param``."""
    texts = valid_texts(texts, param=param)
    name = engine.info.default_prompt_name
    prefix = engine.info.prompts[name] if name is not None else ""
    return [engine.tokenizer.encode_plain(prefix + text) for text in texts]


async def run_model_call(
    request: Request, inputs: list, call: Callable[[Engine], T], *, param: str = "input"
) -> T | Response:
    """``run_model_outputs`` for an engine call that waits for its own results
    (``AsyncEngine.run_call``: sparse and multi-vector outputs): the same input checks and
    count limit, the queue, the engine's errors as 4xx/5xx, and a 499 if the client left
    meanwhile. ``call`` holds the request to its other limits itself."""
    state, front = state_of(request), model_of(request).front
    check_inputs(state, inputs, param)
    check_input_count(state.settings, len(inputs), param)
    try:
        return await unless_client_leaves(request, front.run_call(len(inputs), call, inputs))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)


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


async def json_answer(request: Request, build: Callable[[], Any], size: int = 0) -> Response:
    """The JSON answer ``build()`` returns, built and serialised on a tokenising lane
    (``AsyncEngine.offload``; ``size``: its numbers and characters, which pick the lane):
    thousands of numbers, or the documents a reranking quotes back, take milliseconds to
    encode, which every other request, of every model, would wait for on the event loop."""
    text = await model_of(request).front.offload(lambda: json_bytes(build()), size=size)
    return Response(text, media_type="application/json")


async def binary_answer(
    request: Request, outputs: Vectors, wire: Wire, head: dict, num_tokens: list[int]
) -> Response:
    """vLLM's binary answer of ``outputs`` (``encoding.binary_response``), built on a
    tokenising lane as ``json_answer`` builds JSON."""
    size = sum(out.size for out in outputs)
    return await model_of(request).front.offload(
        lambda: binary_response(outputs, wire, head, num_tokens), size=size
    )


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


def check_inputs(state: ServerState, inputs: list, param: str = "input") -> None:
    """400 for an empty input list, and for token ids unless the server was told to take
    them (``--allow-token-ids``): ids of another tokenizer would give wrong vectors silently."""
    if not inputs:
        raise APIError(400, f"{param} is empty: send at least one text", param=param)
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


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """Await the engine; if the client disconnects first, cancel (which aborts the engine
    requests and frees their KV blocks) and raise ClientGone. If the server stops waiting
    first (shutdown timeout), cancel and answer 503."""
    abandoned = model_of(request).front.abandoned
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
        raise ClientGone
    error = task.exception()
    if error is None:
        return task.result()
    # Raised from inside ``task.result()``, the error's traceback would hold this frame, which
    # holds ``task``, which holds the error: a reference cycle keeping the request (its body
    # too) alive until the collector's next full pass. A flood of refused requests made those
    # passes pause the front end, and every model's requests, ~100 ms at a time.
    del task, watcher, giving_up
    if isinstance(error, QueueFullError):
        raise APIError(
            429, str(error), type=RATE_LIMIT, code="queue_full", headers=retry_later_headers()
        )
    if isinstance(error, PipepoolError):
        raise from_engine(error)
    try:
        raise error
    finally:
        del error  # the same cycle: this frame, in the traceback, would hold the error


async def _disconnected(request: Request) -> None:
    # The body was read already, so the next message is the disconnect (uvicorn sends it
    # when the connection drops; it never comes if the response completes first).
    while (await request.receive())["type"] != "http.disconnect":
        pass
