"""Host time goes to online requests first: background work waits while one is in flight.

A batch's lines are answered in the server's own process (``batch_runner.py``), on a thread
and event loop of their own, and their Python (parsing, routing, serialising each line's
answer) shares the process's interpreter lock with the online requests. The engine already
keeps batch work out of the steps that carry online requests (``core.priority``); this does the
same for host time: while an online request is in flight in this process, the batch's event
loop runs none of its tasks, and its tokenising and serialising lane takes no new work.

A background thread waits at most ``max_wait_s`` at a time; once a wait ends with online
requests still in flight, background work has its turn: for ``BACKGROUND_SHARE`` of the time
(a twentieth: 5 ms after each 100 ms wait) it runs without waiting, so under online traffic
that never pauses a batch still moves at a known share of the host; between online requests
it runs at full speed. (The engine owes batch work a tenth of its tokens:
``core.scheduler.BACKGROUND_SHARE``.)
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Coroutine, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from ..core.priority import is_background

__all__ = ["GATE", "BackgroundPool", "OnlineGate", "OnlineRequests", "gated_task_factory"]

T = TypeVar("T")

# How long a serving process must have had no online request in flight before it counts as
# settled: a gap between requests of steady traffic is no quiet moment for work that pauses the
# process (a full collection, ``runtime.collector.QuietCollections``), since that work would
# hold up the next request for its whole length.
SETTLED_S = 1.0
# The share of host time background work gets while online requests never pause. A twentieth
# moved 46% of a 2,000-line batch in 60 s behind 24 online clients on 2 cores, with the online
# rate and p99 as without the batch; a tenth moved all of it in 53 s, but took a third of the
# online rate (benchmarks/batch_share.py).
BACKGROUND_SHARE = 0.05


class OnlineGate:
    """Counts the online requests in flight in this process; ``wait_for_quiet`` holds a
    background thread (its interpreter lock released) until there are none, ``max_wait_s`` at
    most, and none at all during background work's turn (``BACKGROUND_SHARE`` of the time,
    after a wait that online requests never let end early). Thread-safe."""

    def __init__(
        self, max_wait_s: float = 0.1, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_wait_s = max_wait_s
        self._clock = clock
        self._quiet = threading.Condition()
        self._online = 0
        self._last_ended = clock()  # when the count last fell to 0
        self._turn_ends = -1.0  # background work's turn runs until then

    @property
    def online(self) -> int:
        return self._online

    def quiet(self) -> bool:
        """Whether no online request is in flight now."""
        return not self._online

    def quiet_for(self, seconds: float) -> bool:
        """Whether no online request has been in flight for ``seconds``."""
        return not self._online and self._clock() - self._last_ended >= seconds

    def settled(self) -> bool:
        """Whether no online request has been in flight for ``SETTLED_S``."""
        return self.quiet_for(SETTLED_S)

    @contextlib.contextmanager
    def online_request(self) -> Iterator[None]:
        """An online request is in flight inside."""
        with self._quiet:
            self._online += 1
        try:
            yield
        finally:
            with self._quiet:
                self._online -= 1
                if not self._online:
                    self._last_ended = self._clock()
                    self._quiet.notify_all()

    def wait_for_quiet(self) -> None:
        """Return once no online request is in flight, or after ``max_wait_s``, or at once
        during background work's turn."""
        if self.quiet() or self._clock() < self._turn_ends:  # without the lock
            return
        with self._quiet:
            if not self._quiet.wait_for(self.quiet, self.max_wait_s):
                turn = self.max_wait_s * BACKGROUND_SHARE / (1 - BACKGROUND_SHARE)
                self._turn_ends = self._clock() + turn


GATE = OnlineGate()  # the process's: its online requests, its background work


class OnlineRequests:
    """ASGI middleware: every HTTP request that is not background work (a batch line,
    ``core.priority``) counts as online in ``gate`` while the app answers it."""

    def __init__(self, app, gate: OnlineGate = GATE) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or is_background():
            await self.app(scope, receive, send)
            return
        with self.gate.online_request():
            await self.app(scope, receive, send)


class _Gated(Coroutine):
    """A task's coroutine that waits for ``gate`` before each step it takes."""

    __slots__ = ("_coro", "_gate")

    def __init__(self, coro: Coroutine, gate: OnlineGate) -> None:
        self._coro = coro
        self._gate = gate

    def send(self, value: Any) -> Any:
        self._gate.wait_for_quiet()
        return self._coro.send(value)

    def throw(self, *args: Any) -> Any:
        self._gate.wait_for_quiet()
        return self._coro.throw(*args)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, None, Any]:
        return self._coro.__await__()

    def __getattr__(self, name: str) -> Any:
        # cr_frame, cr_running, cr_code...: what asyncio and anyio read of a task's coroutine.
        return getattr(self._coro, name)


def gated_task_factory(gate: OnlineGate = GATE) -> Callable[..., asyncio.Task]:
    """A task factory (``loop.set_task_factory``) for a background event loop: each step of
    each of its tasks waits for ``gate``."""

    def factory(loop: asyncio.AbstractEventLoop, coro: Coroutine, **kwargs: Any) -> asyncio.Task:
        return asyncio.Task(_Gated(coro, gate), loop=loop, **kwargs)

    return factory


class BackgroundPool(ThreadPoolExecutor):
    """A thread pool for background work: each call waits for ``gate`` before it runs."""

    def __init__(self, max_workers: int, *, thread_name_prefix: str, gate: OnlineGate = GATE):
        super().__init__(max_workers, thread_name_prefix=thread_name_prefix)
        self.gate = gate

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        return super().submit(self._after_quiet, fn, *args, **kwargs)

    def _after_quiet(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        self.gate.wait_for_quiet()
        return fn(*args, **kwargs)
