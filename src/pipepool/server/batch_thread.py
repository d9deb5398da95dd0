"""The server's batches in a thread of their own (``BatchThread``): its own event loop and app
over the server's engines, running ``batch_runner.BatchRunner`` on the state directory."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..jobs.batch_lines import LINE_ENVELOPE_BYTES
from ..runtime.signal_mask import block_stop_signals
from .batch_runner import WINDOW_INPUTS, BatchRunner, Dispatcher, EngineFailedError
from .front import AsyncEngine
from .online_gate import gated_task_factory
from .settings import ServerSettings

if TYPE_CHECKING:
    from .models import ServedModels

__all__ = ["BatchThread", "window_for"]

log = logging.getLogger("pipepool.server")


def _log_failure_of(exc: BaseException) -> None:
    if isinstance(exc, EngineFailedError):
        log.warning("batches stopped: %s", exc)
    else:
        log.error("the batch runner failed", exc_info=exc)


class BatchThread:
    """The batches of a server's main process, run in a thread of their own: its own event
    loop, and its own app (``build_app``) over its own ``AsyncEngine`` on each of the server's
    engines.
    Thousands of batch lines in flight, each a request through the app's routes, never queue
    in the event loop that answers online requests; their engine calls are background work
    (``core.priority``), and their host work waits while an online request is in flight
    (``online_gate``: every task step of this thread's loop, every call of its lane). Batches
    come from the server's state directory, within its limits. ``stopping()``: the server is
    shutting down (the runner stops sending lines)."""

    def __init__(
        self, settings: ServerSettings, models: ServedModels, *, stopping: Callable[[], bool]
    ) -> None:
        from .app import build_app  # the app is built here, not imported by it

        owners = [model.front.owner for model in models]
        self.fronts = {
            i: AsyncEngine(model.front.owner, max_queued=model.front.max_queued)
            for i, model in enumerate(models)
        }
        dispatcher = Dispatcher(
            build_app(settings, models.with_fronts(self.fronts)),
            api_key=settings.api_key,
            engine_failed=lambda: any(owner.error is not None for owner in owners),
        )
        self.runner = BatchRunner(
            settings.batch_state_dir,
            dispatcher,
            max_requests=settings.max_batch_requests,
            max_line_bytes=settings.max_body_bytes + LINE_ENVELOPE_BYTES,
            ready=lambda: all(owner.engine is not None for owner in owners),
            stopping=stopping,
            window_inputs=window_for(settings),
        )
        self._thread = threading.Thread(target=self._run, name="pipepool-batches", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        """Wait (``timeout`` seconds at most) for the runner to stop after ``stopping()``."""
        if self._thread.is_alive():
            self._thread.join(timeout)
        for front in self.fronts.values():
            front.close()

    def _run(self) -> None:
        block_stop_signals()  # SIGTERM and Ctrl-C are the server's

        def gated_loop() -> asyncio.AbstractEventLoop:
            # Every step of every task here waits while an online request is in flight.
            loop = asyncio.new_event_loop()
            loop.set_task_factory(gated_task_factory())
            return loop

        try:
            with asyncio.Runner(loop_factory=gated_loop) as runner:
                runner.run(self._serve())
        except BaseException as exc:  # logged: a thread's exception would vanish
            _log_failure_of(exc)

    async def _serve(self) -> None:
        try:
            await self.runner.run()
        finally:
            await self.runner.dispatcher.aclose()


def window_for(settings: ServerSettings) -> int:
    """Inputs in flight for a batch: ``WINDOW_INPUTS``, or half the server's queue if less."""
    return max(1, min(WINDOW_INPUTS, settings.max_queued_requests // 2))
