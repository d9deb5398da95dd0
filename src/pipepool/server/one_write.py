"""An answer's head and body in one write to the socket.

uvicorn writes a response's status line and headers as soon as the app starts the response,
and its body in a second write: two system calls, and on a loopback or LAN link often two TCP
segments, for an answer of a few hundred bytes. On a one-text embedding request that was
~18% of the event loop thread's samples (docs/benchmarks/served.md). Here the head of an
answer of known length (``content-length``, not HEAD, not empty) is held until its first body
bytes, and both go out in one ``writelines``: such a body always follows at once (uvicorn
refuses a response shorter than its content-length, and closes the connection, which sends
the head first). Streamed (chunked) and empty answers are written as uvicorn writes them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

__all__ = ["hold_head"]


class _HeadWithBody:
    """The transport a ``RequestResponseCycle`` writes through: every call goes to the
    connection's transport, except the head of an answer of known length, held until the
    body's first bytes (or a close) and written with them."""

    __slots__ = ("_cycle", "_head", "_head_seen", "_transport")

    def __init__(self, transport: asyncio.Transport, cycle: RequestResponseCycle) -> None:
        self._transport = transport
        self._cycle = cycle
        self._head: bytes | None = None
        self._head_seen = False

    def write(self, data: bytes) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            self._transport.writelines((head, data))
            return
        cycle = self._cycle
        # The first write once the response started is its head (before it, a "100
        # Continue"): uvicorn writes it when it starts the response, having read the
        # content-length from the headers.
        if not self._head_seen and cycle.response_started:
            self._head_seen = True
            if (
                cycle.chunked_encoding is False
                and cycle.expected_content_length > 0
                and cycle.scope["method"] != "HEAD"
            ):
                self._head = data
                return
        self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def _flush(self) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            self._transport.write(head)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def hold_head(cycle: RequestResponseCycle | None) -> None:
    """Make ``cycle`` (a request's, just made by uvicorn's ``on_headers_complete``) write each
    answer of known length in one write."""
    if cycle is not None and not isinstance(cycle.transport, _HeadWithBody):
        cycle.transport = _HeadWithBody(cycle.transport, cycle)  # type: ignore[assignment]
