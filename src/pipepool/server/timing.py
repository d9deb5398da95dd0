"""Where a request's time went, told to the client in a ``Server-Timing`` header (W3C Server
Timing: browsers' developer tools and most HTTP tooling read it).

Every answer carries ``app;dur=…`` (milliseconds from the app being called, before the body is
read, to the answer's first byte); an answer from the engine also ``tokenize;dur=…`` (its
inputs waiting for a tokenising thread, then tokenised and enqueued), ``lane;dur=…`` (the
first part of ``tokenize``: the wait for the thread) and ``engine;dur=…`` (from
enqueued to its outputs: the queue and the steps; for sparse and multi-vector outputs, one call
on the tokenising thread, its tokenising too); where a replica process computed it,
``replica;dur=…``: the time its last outputs spent in that process, from their batch's arrival
to the outputs. A batch leaves as it is enqueued, within ``tokenize`` (a one-slice call's at
its end), so ``replica`` lies within ``tokenize`` and ``engine`` together, mostly within
``engine``, whose rest is the way there and back (the front end's threads, the sockets); where
the answer was serialised on a thread, ``offload;dur=…``. The rest of ``app`` is the event
loop's: reading, checking and parsing the body, and building the answer. Time a request spends
before the app is called (the connection's bytes waiting for the event loop, HTTP parsing) is
the client's latency less ``app``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["add", "header", "phase", "timed_request"]

_PARTS: ContextVar[list[tuple[str, float]] | None] = ContextVar("pipepool_timing", default=None)


@contextlib.contextmanager
def timed_request(parts: list[tuple[str, float]]) -> Iterator[None]:
    """The request answered inside is timed: its phases (``phase``, ``add``) land in ``parts``."""
    token = _PARTS.set(parts)
    try:
        yield
    finally:
        _PARTS.reset(token)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the code inside as phase ``name`` of the request being answered (if it is timed;
    a phase entered twice adds up)."""
    parts = _PARTS.get()
    if parts is None:
        yield
        return
    started = time.perf_counter()
    try:
        yield
    finally:
        parts.append((name, time.perf_counter() - started))


def add(name: str, seconds: float) -> None:
    """Count ``seconds`` as phase ``name`` of the request being answered, if it is timed."""
    parts = _PARTS.get()
    if parts is not None:
        parts.append((name, seconds))


def header(parts: list[tuple[str, float]], app_s: float) -> tuple[bytes, bytes]:
    """The ``Server-Timing`` header of a request whose app took ``app_s`` with ``parts``."""
    totals: dict[str, float] = {}
    for name, seconds in parts:
        totals[name] = totals.get(name, 0.0) + seconds
    entries = [f"app;dur={app_s * 1000:.2f}"]
    entries += [f"{name};dur={seconds * 1000:.2f}" for name, seconds in totals.items()]
    return b"server-timing", ", ".join(entries).encode("ascii")
