"""Keep Ctrl-C and SIGTERM off the engine's worker threads.

The kernel hands a process-directed signal to any thread that does not block it. Landing on
the engine loop or on a transport thread (gloo's and NCCL's I/O threads, which inherit the
mask of the thread that starts them), it would only interrupt a system call there; Python
runs its handlers in the main thread anyway. Blocked in those threads, the signals always
reach the main thread.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def block_stop_signals() -> None:
    """Block the stop signals in the calling thread and every thread it starts from now on."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Threads started inside inherit blocked stop signals; the caller's mask is restored
    after (a signal that arrived meanwhile is delivered then)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def unblock_stop_signals() -> None:
    """For a process's main thread: a process started from a thread that blocks the stop
    signals inherits that mask, and would never see a SIGTERM."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
