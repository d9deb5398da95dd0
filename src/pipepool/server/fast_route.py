"""A route whose well-formed JSON body skips FastAPI's request machinery.

FastAPI answers each request through its generic handler: the body's content type parsed with
``email.message``, the endpoint's context extracted for error messages, its dependencies
solved, the body validated through a field adapter. For a one-text embedding request that was
a good part of the event loop's ~0.5 ms (docs/benchmarks/served.md). A ``FastBodyRoute``
whose endpoint takes only a pydantic body and the ``Request`` does the same work directly:
the body parsed by orjson (RFC 8259 JSON: what it takes, ``json.loads`` reads the same) and
validated by the model, the endpoint called with both. Anything else (another content type,
a body orjson refuses, one that fails validation) goes to FastAPI's own handler, which
answers it as it always did (its 400 and 422 bodies, ``errors.py``): the fast path only ever
answers requests that the generic one would have passed to the endpoint with the same body.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

__all__ = ["FastBodyRoute"]

Handler = Callable[[Request], Coroutine[Any, Any, Response]]


class FastBodyRoute(APIRoute):
    """An ``APIRoute`` (``APIRouter(route_class=FastBodyRoute)``) that answers a request with
    a JSON body its model accepts without FastAPI's generic handler, where its endpoint takes
    exactly a pydantic model body and the ``Request``; every other request, and every route
    of another shape, through that handler."""

    def get_route_handler(self) -> Handler:
        generic = super().get_route_handler()
        if self.fast_shape is None:
            return generic

        async def handler(request: Request) -> Response:
            answer = await self.fast_answer(request)
            return answer if answer is not None else await generic(request)

        return handler

    @functools.cached_property
    def fast_shape(self) -> tuple[type[BaseModel], str, str] | None:
        """(body model, its parameter, the request's parameter) where the endpoint takes
        exactly a pydantic body and the ``Request``: the routes with a fast path; else None."""
        return _body_and_request(self)

    async def fast_answer(self, request: Request) -> Response | None:
        """The endpoint's answer to ``request`` where the route has a fast path
        (``fast_shape``), its body is JSON the body model accepts and the endpoint answers with
        a ``Response``; None where FastAPI's generic handler must answer it (the body, read
        here, stays readable from ``request``)."""
        if self.fast_shape is None:
            return None
        model, body_name, request_name = self.fast_shape
        body = await _valid_body(request, model)
        if body is None:
            return None
        answer = await self.endpoint(**{body_name: body, request_name: request})
        if not isinstance(answer, Response):  # serialised by FastAPI's response model
            return None
        return answer


def _body_and_request(route: APIRoute) -> tuple[type[BaseModel], str, str] | None:
    """(body model, its parameter, the request's parameter) of an async endpoint that takes
    only those two; None for any other."""
    d = route.dependant
    others = (
        d.path_params, d.query_params, d.header_params, d.cookie_params, d.dependencies,
        d.response_param_name, d.background_tasks_param_name, d.websocket_param_name,
        d.http_connection_param_name, d.security_scopes_param_name,
    )  # fmt: skip
    if any(others) or len(d.body_params) != 1 or d.request_param_name is None:
        return None
    field = d.body_params[0]
    model = field.field_info.annotation
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return None
    if route._embed_body_fields or not inspect.iscoroutinefunction(route.endpoint):
        return None
    return model, field.name, d.request_param_name


async def _valid_body(request: Request, model: type[BaseModel]) -> BaseModel | None:
    """The request's body as ``model``, where it is JSON that ``model`` accepts; else None."""
    content_type = request.headers.get("content-type", "")
    media = content_type.partition(";")[0].strip().lower()
    if media != "application/json":
        return None
    raw = await request.body()
    if not raw:
        return None
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    try:
        return model.model_validate(data)
    except ValidationError:
        return None
