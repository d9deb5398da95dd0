"""Background work and clients' turns: who an engine call is for, beyond the call itself.

Background work runs only where online calls leave room.
A batch job (the server's Batch API, ``pipepool run-batch``) marks its calls as background
with ``background_work()``; every engine call made inside it, in this thread or in a task or
thread that copied this context (``contextvars.copy_context``), is queued behind every online
call not yet admitted and goes only into steps that take no online work, so a step that
carries online requests is as short as they make it, save for its share: while it waits it is
owed a tenth of the tokens planned, paid in small parts beside the online work
(``core.scheduler.BACKGROUND_SHARE``), so that a batch moves under any online load. Work
already admitted into a step runs to its end whatever comes later: online latency is bounded
by the steps in flight, not by the size of a batch.

Clients' turns: calls take turns step by step (``core.scheduler``), each call one turn. Calls
made inside ``client_turns(key)`` share one turn, that of client ``key``: a client with a
hundred calls in flight gets the share of a client with one (the server keys turns by the
client's address).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["background_work", "client_turns", "current_client", "is_background", "turn_of"]

_BACKGROUND: ContextVar[bool] = ContextVar("pipepool_background", default=False)
_CLIENT: ContextVar[str | None] = ContextVar("pipepool_client", default=None)


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


@contextlib.contextmanager
def client_turns(client: str | None) -> Iterator[None]:
    """Engine calls made inside take turns as client ``client``'s (None: each its own)."""
    token = _CLIENT.set(client)
    try:
        yield
    finally:
        _CLIENT.reset(token)


def current_client() -> str | None:
    """The client a call made here now is for (``client_turns``), if any."""
    return _CLIENT.get()


def turn_of(client: str) -> int:
    """The scheduler's turn (``RequestBatch.call``) of every call of ``client``: a negative
    number, never a request id, the same in every process."""
    digest = hashlib.blake2b(client.encode("utf-8", "surrogatepass"), digest_size=7).digest()
    return -1 - int.from_bytes(digest, "big")
