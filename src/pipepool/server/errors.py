"""The error bodies the server sends, one shape per route family (``error_shape``):

- OpenAI's, ``{"error": {"message", "type", "param", "code"}}``, on every route but TEI's, so the
  official clients (openai, cohere, vLLM's) raise their usual exception classes
  (BadRequestError, AuthenticationError, RateLimitError, ...);
- text-embeddings-inference's, ``{"error": str, "error_type": str}`` with TEI's statuses, on
  the routes only TEI defines (``TEI_PATHS``), and on ``/rerank`` and ``/tokenize``, which other
  peers define too, for a body in TEI's form (``TEI_FORMS``: ``texts``, ``inputs``):
  ``tei_answer`` maps each error to TEI's.

An error is raised once, as an ``APIError`` (OpenAI's fields); its shape is chosen where it is
answered, by the request it answers."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Scope

from ..errors import EngineDeadError, InvalidInputError, PromptTooLongError

log = logging.getLogger("pipepool.server")

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
RATE_LIMIT = "rate_limit_error"
SERVER = "server_error"
# The code of a request with nothing in it to compute (TEI's Empty: 400 on TEI routes).
EMPTY = "empty"

# How long a refused client is told to wait, in milliseconds: about a second, spread evenly over
# this range so that clients refused together do not come back together. A herd of retries is a
# burst of bodies to read and parse on the front end's one event loop, which every model's
# requests wait behind.
RETRY_AFTER_MS = (500, 1500)


def retry_later_headers() -> dict[str, str]:
    """The headers of a 429: ``Retry-After`` in whole seconds (RFC 9110), and the spread
    ``Retry-After-Ms`` that the official OpenAI clients read before it."""
    return {"Retry-After": "1", "Retry-After-Ms": str(random.randint(*RETRY_AFTER_MS))}


class APIError(Exception):
    """An answer other than success: HTTP status plus the OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, scope: Scope | None = None) -> JSONResponse:
        """The answer to the request of ``scope`` (its route family picks the body's shape:
        ``error_shape``); OpenAI's shape where there is no request to look at."""
        if scope is not None and error_shape(scope) == TEI:
            status, error_type = tei_answer(self)
            body = {"error": self.message, "error_type": error_type}
            return _AsciiJSON(body, status_code=status, headers=self.headers)
        return _AsciiJSON(self.body(), status_code=self.status, headers=self.headers)


OPENAI = "openai"
TEI = "tei"

# The routes only text-embeddings-inference defines: their errors have TEI's shape. POST / and
# /invocations answer as TEI does (``routes/tei_root.py``).
TEI_PATHS = frozenset(
    {"/", "/invocations", "/embed", "/embed_all", "/embed_sparse", "/predict", "/similarity",
     "/decode", "/info"}
)  # fmt: skip


# Routes other peers define too, where a body with the first field and none of the others
# (the other peers' forms) is TEI's request: its errors have TEI's shape, as its answer has.
TEI_FORMS = {
    "/rerank": ("texts", "documents"),
    "/v1/rerank": ("texts", "documents"),
    "/v2/rerank": ("texts", "documents"),
    "/tokenize": ("inputs", "prompt", "input"),
}
_SHAPE = "pipepool_error_shape"  # the request's shape, where its body chose it (scope's state)


def error_shape(scope: Scope) -> str:
    """The error body's shape for the request of ``scope``: TEI's on ``TEI_PATHS`` and for a
    body in TEI's form (``answer_as_tei``), OpenAI's everywhere else."""
    if scope.get("path") in TEI_PATHS or scope.get("state", {}).get(_SHAPE) == TEI:
        return TEI
    return OPENAI


def answer_as_tei(scope: Scope) -> None:
    """Answer the request of ``scope`` in TEI's error shape: its body is in TEI's form."""
    scope.setdefault("state", {})[_SHAPE] = TEI


def in_tei_form(scope: Scope, body: Any) -> bool:
    """Whether ``body`` (parsed JSON) is TEI's form of a route other peers define too."""
    fields = TEI_FORMS.get(scope.get("path", ""))
    if fields is None or not isinstance(body, dict):
        return False
    tei_field, *others = fields
    return tei_field in body and not any(f in body for f in others)


def tei_answer(err: APIError) -> tuple[int, str]:
    """TEI's status and ``error_type`` for an error (its ``ErrorType`` and the status each
    has): Empty 400 (no inputs, an empty text); Validation 413 (more inputs than
    max_client_batch_size, a body over the limit), 422 (any other bad field or input, an input
    too long); Backend 424 (a model that does not do what the route asks: an embedding model's
    /predict); Overloaded 429; Unhealthy 503 (loading, engine failed, shutting down). Errors
    TEI has no type for keep their status: 401 (Unauthorized), 405, 408 (Validation), 500
    (Backend)."""
    status, code = err.status, err.code
    if status == 400:
        if code == EMPTY:
            return 400, "Empty"
        if code == "too_many_inputs":
            return 413, "Validation"
        return 422, "Validation"
    if status == 404 and code == "unsupported_task":
        return 424, "Backend"
    if status == 429:
        return 429, "Overloaded"
    if status == 503:
        return 503, "Unhealthy"
    if status == 401:
        return 401, "Unauthorized"
    if status >= 500:
        return status, "Backend"
    return status, "Validation"


class _AsciiJSON(JSONResponse):
    """JSON with non-ASCII characters escaped. An error message may quote what a client sent,
    and a lone surrogate in it (JSON's ``"\\ud800"``) cannot be encoded as UTF-8: starlette's
    JSONResponse would raise while answering and break the connection."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def from_engine(exc: Exception) -> APIError:
    """The answer to an exception the engine raised for a request."""
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, InvalidInputError):
        return APIError(400, str(exc), param=exc.param, code="invalid_value")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type=SERVER, code="engine_unavailable")
    # The exception's text may name files or internals of the server: it goes to the log only.
    log.exception("unexpected error while serving a request", exc_info=exc)
    return APIError(
        500,
        "internal error while serving this request (the server's log has the details)",
        type=SERVER,
        code="internal_error",
    )


def model_not_found(name: str, served: tuple[str, ...] = ()) -> APIError:
    known = f" This server serves: {', '.join(served)}." if served else ""
    return APIError(
        404,
        f"The model `{name}` does not exist or you do not have access to it.{known}",
        param="model",
        code="model_not_found",
    )


def install_handlers(app: FastAPI, on_error: Callable[[APIError], None]) -> None:
    """Route every failure, FastAPI's own included, through the error body of its route's
    family (``APIError.response``).

    ``on_error`` sees each error sent (for the error counters in /metrics).
    """

    def send(err: APIError, request: Request) -> JSONResponse:
        on_error(err)
        return err.response(request.scope)

    # Starlette types every handler as taking any Exception (its stub cannot tie the handler to
    # the class it is registered for): each narrows to the class it is registered under.
    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return send(exc, request)

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        # FastAPI answers 422 with its own body; OpenAI clients expect 400 and "error" (TEI's
        # routes answer 422, ``tei_answer``).
        if in_tei_form(request.scope, exc.body):
            answer_as_tei(request.scope)
        return send(_wrong_content_type(request, exc) or _from_validation(exc), request)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kind = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:
            headers = {**(headers or {}), "Allow": _allowed_methods(request)}
        return send(
            APIError(exc.status_code, str(exc.detail), type=kind, code=code, headers=headers),
            request,
        )

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette answers an unexpected exception from its outermost middleware, then raises
        # it on to uvicorn, which closes the connection: the answer says so, so that a
        # keep-alive client opens a new connection rather than write into a closed one.
        response = send(from_engine(exc), request)
        response.headers["Connection"] = "close"
        return response

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


def _allowed_methods(request: Request) -> str:
    """Every method of the routes at the request's path: starlette's 405 names those of the
    first such route only (``GET /v1/batches`` and ``POST /v1/batches`` are two routes)."""
    methods: set[str] = set()
    for route in _leaves(request.app.router.routes):
        if route.matches(request.scope)[0] is not Match.NONE:
            methods.update(getattr(route, "methods", None) or ())
    return ", ".join(sorted(methods))


def _leaves(routes: list) -> Iterator:
    """The routes of ``routes``, those of an included router in its place (FastAPI keeps an
    included router whole, as ``original_router``; the app's are included without a prefix)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is None:
            yield route
        else:
            yield from _leaves(inner.routes)


def _wrong_content_type(request: Request, exc: RequestValidationError) -> APIError | None:
    """FastAPI parses a body as JSON only when its Content-Type says JSON (or is absent); any
    other type reaches validation as raw bytes. Say so, instead of "not an object"."""
    kind = request.headers.get("content-type")
    if kind is None or "json" in kind.lower():
        return None
    if not any(tuple(e.get("loc", ())) == ("body",) for e in exc.errors()):
        return None
    return APIError(
        400,
        "the request body must be JSON sent with the header 'Content-Type: application/json'; "
        f"this request said 'Content-Type: {kind}'",
        code="invalid_content_type",
    )


def _from_validation(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        why = (first.get("ctx") or {}).get("error") or first.get("msg", "")
        return APIError(400, f"request body is not valid JSON: {why}")
    if kind == "missing" and not loc:
        return APIError(400, "request body is missing: send a JSON object")
    # Only the field a client sent is worth naming; pydantic adds union branch names
    # (e.g. "list[int]") and list indexes after it.
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    unknown = [
        ".".join(str(part) for part in e.get("loc", ()) if part != "body")
        for e in errors
        if e.get("type") == "extra_forbidden"
    ]
    if kind == "extra_forbidden":  # every unknown field named, in OpenAI's words
        several = "s" if len(unknown) > 1 else ""
        message = f"Unrecognized request argument{several} supplied: {', '.join(unknown)}"
    else:
        message = f"{where}: {first.get('msg', 'invalid value').removeprefix('Value error, ')}"
    more = len(errors) - (len(unknown) if kind == "extra_forbidden" else 1)
    if more:
        message += f" (and {more} more problem{'s' if more > 1 else ''})"
    return APIError(400, message, param=param, code="invalid_value")
