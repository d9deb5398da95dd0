"""uvicorn's server, with a start that says when its sockets are bound and a shutdown that
answers every request.

On SIGTERM uvicorn stops accepting connections and waits for the requests in flight; when its
``timeout_graceful_shutdown`` runs out it cancels them, and each is answered a plain-text 500
with a traceback in the log. Here, requests still running when the shutdown timeout ends are
answered by their own routes instead: 503 with an OpenAI error body (``AsyncEngine.abandoned``).
uvicorn's own timeout comes a little later, as a last resort.
"""

from __future__ import annotations

from collections.abc import Callable

import uvicorn

from ..runtime import switch_interval
from .app import ServerState, build_app
from .connections import MAX_HEADER_BYTES, ConnectionGuard, guarded_protocol
from .models import ServedModels
from .settings import ServerSettings

# Time the routes get to send their 503s before uvicorn cancels what is left.
ANSWER_GRACE_S = 5.0


class Server(uvicorn.Server):
    """uvicorn's server with the engine's lifecycle: ``on_started`` once it listens, and on
    SIGTERM in-flight requests drain for up to ``timeout_s`` before the front end closes.
    While it listens, the process's thread switch interval is at most ``switch_interval_s``
    (``runtime/switch_interval.py``; 0: left alone), so that the event loop's thread gets the
    interpreter's lock back promptly from the threads that serialise answers."""

    def __init__(
        self,
        config: uvicorn.Config,
        models: ServedModels,
        timeout_s: float,
        on_started: Callable[[], None] = lambda: None,
        switch_interval_s: float = 0.0,
    ) -> None:
        # uvicorn annotates int but only hands it to asyncio.wait_for, which takes seconds.
        config.timeout_graceful_shutdown = timeout_s + ANSWER_GRACE_S  # type: ignore[assignment]
        super().__init__(config)
        self.models = models
        self.timeout_s = timeout_s
        self.on_started = on_started
        self.on_shutdown: Callable[[], None] = lambda: None  # when it stops accepting
        self.switch_interval_s = switch_interval_s
        self._lowered = False

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started:  # False when the port could not be bound
            self._lowered = switch_interval.lower(self.switch_interval_s)
            self.on_started()

    async def shutdown(self, sockets=None) -> None:
        self.on_shutdown()
        for model in self.models:
            model.front.abandon_after(self.timeout_s)
        await super().shutdown(sockets)
        if self._lowered:
            self._lowered = False
            switch_interval.restore()


def build_server(
    settings: ServerSettings,
    models: ServedModels,
    logs: dict,
    on_started: Callable[[], None],
    switch_interval_s: float = 0.0,
) -> Server:
    """The server of one front-end process (the main one, or one of ``--api-server-count``):
    the app, behind the connection guards (``connections.py``: each process counts its own
    connections); ``on_started`` once it accepts connections; ``switch_interval_s``: see
    ``Server``."""
    app = build_app(settings, models)
    state: ServerState = app.state.pipepool
    guard = ConnectionGuard(
        max_per_client=settings.max_connections_per_client,
        header_timeout_s=settings.header_timeout_s,
        counts=state.http.connections,
    )
    config = uvicorn.Config(
        app,
        http=guarded_protocol(guard),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,  # h11's bound on headers, as httptools'
        ws="none",  # no WebSocket routes: an upgrade would leave the connection uncounted
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,  # the app logs each request, with its latency (metrics.py)
        # uvicorn annotates int but only hands it to loop.call_later, which takes seconds.
        timeout_keep_alive=settings.timeout_keep_alive_s,  # type: ignore[arg-type]
        backlog=settings.backlog,
        lifespan="off",
        log_config=logs,
    )
    return Server(
        config, models, timeout_s=settings.shutdown_timeout_s, on_started=on_started,
        switch_interval_s=switch_interval_s,
    )  # fmt: skip
