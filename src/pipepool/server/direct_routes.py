"""POSTs to the fast embedding routes, straight to their handlers.

Starlette finds a request's route by trying each route of the app in turn, and FastAPI wraps
the one it finds in per-request machinery of its own (the route's handle, its request and
response cycle, two exit stacks): with nothing behind the endpoint, a one-text embedding
request cost the server 79-92 µs of CPU through the router and 51-60 µs past it, a bare ASGI
app 22-24 (``benchmarks/asgi_floor.py``, docs/benchmarks/served.md). A POST to the exact path
of a ``FastBodyRoute`` with a body of the route's fast path goes to its endpoint here, inside
the same handlers of errors as the app's own routes; any other request, to the app's router.
"""

from __future__ import annotations

from collections.abc import Iterable

from fastapi import Request
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .fast_route import FastBodyRoute

__all__ = ["DirectRoutes"]


class DirectRoutes:
    """ASGI middleware, innermost of the app's: a POST whose path is exactly that of one of
    ``routes`` (a POST ``FastBodyRoute`` with a fast path, ``fast_shape``: no path parameters)
    with a body the route takes on its fast path (``FastBodyRoute.fast_answer``) is answered
    by that route's endpoint, its errors by ``exception_handlers`` as the app answers them;
    every other request goes on to ``app``, a body already read handed on unchanged."""

    def __init__(
        self, app: ASGIApp, *, routes: Iterable[BaseRoute], exception_handlers: dict
    ) -> None:
        self.app = app
        self.routes = {
            route.path: route
            for route in routes
            if isinstance(route, FastBodyRoute)
            and route.fast_shape is not None
            and route.methods == {"POST"}
        }
        # As FastAPI builds its own: a 500 is the outermost middleware's to answer.
        handlers = {k: v for k, v in exception_handlers.items() if k not in (500, Exception)}
        self.direct = ExceptionMiddleware(self._answer, handlers=handlers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and not scope.get("root_path")
            and scope["path"] in self.routes
        ):
            await self.direct(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _answer(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        response = await self.routes[scope["path"]].fast_answer(request)
        if response is None:
            await self.app(scope, _replayed(await request.body(), receive), send)
        else:
            await response(scope, receive, send)


def _replayed(body: bytes, receive: Receive) -> Receive:
    """``receive`` with the request's body, already read, handed out once more first."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay
