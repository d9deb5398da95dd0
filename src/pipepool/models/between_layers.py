"""A point between two layers of a forward where the thread computing it may first do other,
short work: the engine's loop runs a step of light calls there while it computes a long step
of other calls (``driver.local``), so a one-word request waits for a layer of a long
encoder window, not for the whole window (issue 57).

The hook is per thread: only the thread that set it (the loop of an in-process pipeline,
which computes its stage) calls it; threads computing tiles side by side (``cpu_lanes``) see
none. Encoder layer loops call ``between_layers()`` before each layer.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

__all__ = ["between_layers", "hooked"]

_local = threading.local()


def between_layers() -> None:
    """Run this thread's hook, if it has one (``hooked``)."""
    hook = getattr(_local, "hook", None)
    if hook is not None:
        hook()


@contextlib.contextmanager
def hooked(hook: Callable[[], None] | None) -> Iterator[None]:
    """Inside, ``between_layers()`` on this thread runs ``hook`` (None: nothing); the hook in
    place before comes back after."""
    old = getattr(_local, "hook", None)
    _local.hook = hook
    try:
        yield
    finally:
        _local.hook = old
