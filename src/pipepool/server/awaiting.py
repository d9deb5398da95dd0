"""Requests awaiting their work, each given up on when its client leaves or when the server
stops waiting for it.

A route awaits its work (an engine call) on the request's own task. One more task a request
reads the connection, and cancels the route's task if the client disconnects first; when the
shutdown timeout ends, ``Awaiting.abandon`` cancels every request still waiting. Each of these
cancellations carries its reason, so that the route tells them apart from a cancellation from
outside (uvicorn's last resort), which goes through untouched. The work is cancelled where it
waits, on the route's task: it aborts its engine requests before the route goes on.

(The request's task and one watch: 18.5-20.0 µs a request in a micro-benchmark on uvloop; a
task for the work, one for the watch, one for the shutdown and ``asyncio.wait`` over the
three: 57.6-64.2 µs. docs/benchmarks/served.md, "Waiting for the engine with one task less".)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

T = TypeVar("T")

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


class GivenUp(Exception):
    """The request's work was cancelled: its client left (``abandoned`` False) or the server
    stopped waiting for it (``abandoned`` True)."""

    def __init__(self, abandoned: bool) -> None:
        super().__init__("abandoned by the server" if abandoned else "the client left")
        self.abandoned = abandoned


class Awaiting:
    """The requests of one front end awaiting their work (``result``), until ``abandon``:
    from then on each, waiting or new, is given up on (``GivenUp(abandoned=True)``). Used on
    the server's event loop only."""

    def __init__(self) -> None:
        self.abandoned = False
        self._waiting: dict[asyncio.Task, list[bool]] = {}  # task -> [abandoned] once cancelled

    def abandon(self) -> None:
        """Give up on every request waiting now, and on every one that waits later."""
        self.abandoned = True
        for task, why in list(self._waiting.items()):
            if not why:
                why.append(True)
                task.cancel()

    async def result(self, work: Awaitable[T], receive: Receive) -> T:
        """``work``'s result, awaited on this task, its errors raised as they are; raises
        ``GivenUp`` once ``work`` was cancelled because the client disconnected (``receive``
        said so) or the server gave up. ``work`` is closed unawaited if the server has."""
        if self.abandoned:
            _close(work)
            raise GivenUp(abandoned=True)
        task = asyncio.current_task()
        assert task is not None, "awaited on a task"
        why: list[bool] = []
        watch = asyncio.ensure_future(_cancel_on_disconnect(receive, task, why))
        self._waiting[task] = why
        try:
            out = await work
        except asyncio.CancelledError:
            if not why:  # from outside: not ours to answer
                raise
            _uncancel()
            raise GivenUp(abandoned=why[0]) from None
        finally:
            # No frame of an error's traceback keeps this task (nor the task its error).
            del self._waiting[task], task
            watch.cancel()
        if why:  # cancelled, and the work finished all the same
            _uncancel()
        return out


async def _cancel_on_disconnect(receive: Receive, task: asyncio.Task, why: list[bool]) -> None:
    # The route read the body already, so the next message is the disconnect (uvicorn sends it
    # when the connection drops; it never comes if the answer is sent first).
    while (await receive())["type"] != "http.disconnect":
        pass
    if not why:
        why.append(False)
        task.cancel()


def _uncancel() -> None:
    """The cancellation this module asked for, handled: later awaits of the task (its
    answer's) are not cancelled (``asyncio.Task.uncancel``)."""
    task = asyncio.current_task()
    assert task is not None, "awaited on a task"
    task.uncancel()


def _close(work: Awaitable[Any]) -> None:
    close = getattr(work, "close", None)  # a coroutine never started: no "never awaited"
    if close is not None:
        close()
