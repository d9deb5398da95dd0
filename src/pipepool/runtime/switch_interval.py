"""The interpreter's thread switch interval while engines run.

The engine's loop thread prepares and launches every step; other threads of the process (callers
packing or tokenising their inputs, the HTTP server) run Python too. A thread that wants the GIL
waits until its holder blocks or the switch interval (5 ms by default) runs out, and on a GPU a step
of a small model takes about 3 ms: at the start of a call of 8192 short queries the loop thread lost
2-4 ms per step to the caller's thread, the GPU waiting (docs/benchmarks/gpu-short-inputs.md, "Sixth
pass": W4 on the MiniLM shape, busy 0.79-0.80 of the wall at 5 ms, 0.84-0.86 at 0.5 ms). So an open
engine lowers the interval, process-wide, and the last one closed puts back what it found, unless
someone changed it meanwhile.

A server's front end lowers it too while it serves (``server/uvicorn_server.Server``): its event
loop gives the lock up at every socket call and waits for it again, and beside a thread that
serialises a large answer (``lock_blocks``: blocks of about a millisecond) each wait lasted the
whole interval. Measured on 2 EPYC cores: a socket round trip of the loop's thread took a median
9.2 ms beside such a thread at 5 ms, 1.6 ms at 1 ms (0.01-0.05 ms alone), the answer's own time
unchanged (52-53 ms).
"""

from __future__ import annotations

import sys
import threading

_lock = threading.Lock()
_holders = 0
_saved: float | None = None  # the interval found when the first holder lowered it
_ours: float | None = None  # the interval we set


def lower(seconds: float) -> bool:
    """Lower the switch interval to ``seconds`` (never raise it) until ``restore``; returns
    whether the caller holds it (``seconds`` 0: the interpreter's setting is left alone)."""
    global _holders, _saved, _ours
    if seconds <= 0:
        return False
    with _lock:
        current = sys.getswitchinterval()
        if _holders == 0:
            _saved, _ours = current, None
        if seconds < current:
            sys.setswitchinterval(seconds)
            _ours = seconds
        _holders += 1
        return True


def for_configs(intervals_ms: list[float]) -> float:
    """The interval, in seconds, for a process serving models whose ``switch_interval_ms``
    are ``intervals_ms``: the shortest asked for (0: every one leaves it alone)."""
    asked = [ms for ms in intervals_ms if ms > 0]
    return min(asked) / 1000 if asked else 0.0


def restore() -> None:
    """One holder less; the last one puts back the interval found, if it is still ours."""
    global _holders, _saved, _ours
    with _lock:
        _holders -= 1
        if _holders == 0:
            # (The interpreter keeps whole microseconds: 0.0002 reads back as 0.00019999...)
            unchanged = _ours is not None and abs(sys.getswitchinterval() - _ours) < 1e-6
            if unchanged and _saved is not None:
                sys.setswitchinterval(_saved)
            _saved = _ours = None
