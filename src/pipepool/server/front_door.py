"""The one layer of pipepool's own that every HTTP request passes before its route: counted in
the metrics, timed for its ``Server-Timing`` header and access line, in its client's turn, and
held to the guards (API key, body size and pace, lone surrogates).

Each ASGI middleware is a coroutine frame, a ``send`` wrapper and a dict copy per request;
four of them (metrics, client turns, and the two guard classes mounted as layers) were ~45% of
the event loop's samples with Starlette's own on a one-text request, no one of them large
(docs/benchmarks/served.md). Here they are one frame and one ``send`` wrapper.
"""

from __future__ import annotations

import contextlib
import time

from ..core.priority import client_turns
from . import timing
from .metrics import HttpMetrics, log_access
from .settings import ServerSettings
from .upload_guard import UploadGuards


class FrontDoor:
    """ASGI middleware in front of every route: counts each HTTP request by route, status and
    model (also those the guards turn away) and, with ``--access-log``, logs it once answered,
    with its latency; tells the client where its time went (``timing.py``); makes the route's
    engine calls as its client's (``--fair-share client``: keyed by the client's address,
    ``turns.py``); and passes the request through the guards (``UploadGuards``: the API key,
    the body's size and pace, lone surrogates) before the app."""

    def __init__(self, app, *, settings: ServerSettings, metrics: HttpMetrics) -> None:
        self.app = app
        self.metrics = metrics
        self.access_log = settings.access_log
        self.turns_by_client = settings.fair_share == "client"
        self.guarded = UploadGuards(
            app,
            api_key=settings.api_key,
            max_body_bytes=settings.max_body_bytes,
            max_upload_bytes=settings.max_batch_file_bytes,
            body_timeout_s=settings.body_timeout_s,
            on_error=metrics.on_error,
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # If the app raises, the error middleware outside this one answers 500; if it returns
        # without answering, the client left before its request was read (nginx's 499).
        status = 499
        started = time.perf_counter()
        parts: list[tuple[str, float]] = []

        async def send_with_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                spent = timing.header(parts, time.perf_counter() - started)
                message = {**message, "headers": [*message.get("headers", ()), spent]}
            await send(message)

        metrics = self.metrics
        metrics.in_flight += 1
        client = scope.get("client")
        turns = (
            client_turns(f"address:{client[0]}")
            if self.turns_by_client and client
            else contextlib.nullcontext()
        )
        try:
            # The route's task runs in this context; AsyncEngine copies it to its threads.
            with turns, timing.timed_request(parts):
                await self.guarded(scope, receive, send_with_status)
        except BaseException:
            status = 500
            raise
        finally:
            seconds = time.perf_counter() - started
            metrics.in_flight -= 1
            # The model the route chose (``routes.shared.select_model``), in the request's state.
            model = scope.get("state", {}).get("pipepool_model")
            metrics.on_response(scope["path"], status, seconds, model.name if model else "")
            if self.access_log:
                log_access(scope, status, seconds)
