"""Background work: engine calls that run only where online calls leave room.

A batch job (the server's Batch API, ``pipepool run-batch``) marks its calls as background
with ``background_work()``; every engine call made inside it, in this thread or in a task or
thread that copied this context (``contextvars.copy_context``), is queued behind every online
call not yet admitted and goes only into steps that take no online work, so a step that
carries online requests is as short as they make it. Work already admitted into a step runs to
its end whatever comes later: online latency is bounded by the steps in flight, not by the
size of a batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["background_work", "is_background"]

_BACKGROUND: ContextVar[bool] = ContextVar("pipepool_background", default=False)


@contextlib.contextmanager
def background_work() -> Iterator[None]:
    """Engine calls made inside run below online ones (see the module's docstring)."""
    token = _BACKGROUND.set(True)
    try:
        yield
    finally:
        _BACKGROUND.reset(token)


def is_background() -> bool:
    """Whether a call made here now is background work."""
    return _BACKGROUND.get()
