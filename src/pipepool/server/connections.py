"""What a connection may cost the server before its request reaches the app: how long its
headers may take, how large they may be, and how many connections one client address may hold.

uvicorn bounds none of these. A client that opens a connection and sends its headers a byte a
second (slowloris) holds the connection, and a slot of the process's file descriptors, for as
long as it likes; uvicorn's keep-alive timeout only starts once a response has been sent, and
its httptools parser takes headers of any size. Here uvicorn's own protocol classes
(httptools and h11) are subclassed, and ``uvicorn.Config(http=...)`` is handed the subclass:

- a request's headers must be complete within ``header_timeout_s`` of its first byte, or of
  the connection's opening for its first request; else the connection is answered 408 and
  closed. An idle keep-alive connection between requests stays governed by uvicorn's
  ``timeout_keep_alive``: the deadline starts with the next request's first byte;
- a request's headers (its target and every header line) may take ``MAX_HEADER_BYTES``; more
  are answered 400 and closed (h11 holds to the same bound through uvicorn's
  ``h11_max_incomplete_event_size``);
- one client address may hold ``max_per_client`` connections open (0: no cap); a connection
  over it is answered 429 and closed at once, before any of its bytes are read.

A slow body is the app's to bound (``guards.py``): it reads the body.
"""

from __future__ import annotations

import asyncio
import http
import json
from collections import Counter

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .errors import RATE_LIMIT, APIError, retry_later_headers
from .metrics import ConnectionCounts
from .one_write import hold_head

# What one request's target and headers may take: 4x nginx's default header buffer (8 KiB),
# and far above what any client library sends.
MAX_HEADER_BYTES = 64 << 10


class ConnectionGuard:
    """The connection rules of one front-end process, shared by all its connections, on its
    event loop thread: at most ``max_per_client`` open connections per client address (0: no
    cap), each request's headers complete within ``header_timeout_s``. What it turns away is
    counted in ``counts`` (/metrics)."""

    def __init__(
        self, *, max_per_client: int, header_timeout_s: float, counts: ConnectionCounts
    ) -> None:
        assert max_per_client >= 0 and header_timeout_s > 0, "checked by ServerSettings"
        self.max_per_client = max_per_client
        self.header_timeout_s = header_timeout_s
        self.counts = counts
        self.open_by_address: Counter[str] = Counter()

    def admit(self, address: str) -> bool:
        """Whether a new connection from ``address`` may stay open; if so it is counted open
        until ``release``."""
        if self.max_per_client and self.open_by_address[address] >= self.max_per_client:
            self.counts.refused += 1
            return False
        self.open_by_address[address] += 1
        self.counts.open += 1
        return True

    def release(self, address: str) -> None:
        """An admitted connection from ``address`` closed."""
        self.open_by_address[address] -= 1
        if not self.open_by_address[address]:
            del self.open_by_address[address]  # no entry kept per address ever seen
        self.counts.open -= 1


def guarded_protocol(guard: ConnectionGuard, http: str = "httptools") -> type[asyncio.Protocol]:
    """The HTTP protocol class for ``uvicorn.Config(http=...)``: uvicorn's ``http``
    implementation (``httptools`` or ``h11``) held to ``guard``'s rules."""
    base: type[_Guarded] = {"httptools": _GuardedHttpTools, "h11": _GuardedH11}[http]
    return type(base.__name__.lstrip("_"), (base,), {"guard": guard})


class _Guarded(asyncio.Protocol):
    """The rules of ``guard`` over one connection, mixed in before uvicorn's protocol class,
    which tells it when a request's headers begin and end."""

    guard: ConnectionGuard  # set on the class that ``guarded_protocol`` makes
    # Set by uvicorn's connection_made (both implementations).
    transport: asyncio.Transport
    client: tuple[str, int] | None
    loop: asyncio.AbstractEventLoop

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._address = self.client[0] if self.client else ""  # a Unix socket: one address
        self._admitted = self.guard.admit(self._address)
        if not self._admitted:
            self._answer_and_close(_too_many_connections(self.guard.max_per_client))
            return
        self._headers_begin()  # a connection that never sends is held to it too

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_end()
        if self._admitted:
            self._admitted = False
            self.guard.release(self._address)
        super().connection_lost(exc)

    def _answering(self) -> bool:
        """Whether a response to an earlier request on this connection is still being sent."""
        raise NotImplementedError

    def _headers_begin(self) -> None:
        if self._header_timer is None and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(
                self.guard.header_timeout_s, self._headers_late
            )

    def _headers_end(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self._answering():
            # A pipelined request waits for the one before it (uvicorn stops reading until
            # then): the server's time, not the client's.
            self._headers_begin()
            return
        self.guard.counts.header_timeouts += 1
        self._answer_and_close(_headers_too_slow(self.guard.header_timeout_s))

    def _answer_and_close(self, answer: bytes) -> None:
        self._headers_end()
        self.transport.write(answer)
        self.transport.close()  # after the write is flushed


class _GuardedHttpTools(_Guarded, HttpToolsProtocol):
    """httptools calls ``on_message_begin`` at a request's first byte and
    ``on_headers_complete`` at its end of headers; each answer of known length goes out in
    one write (``one_write.py``)."""

    _header_bytes = 0  # of the request being parsed: its target and header lines

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        self._headers_begin()

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._headers_end()
        super().on_headers_complete()
        hold_head(self.cycle)

    def _count_header_bytes(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > MAX_HEADER_BYTES:
            # Raised out of the parser's callback, it stops the parse: uvicorn answers 400
            # ("Invalid HTTP request received.") and closes the connection.
            raise ValueError(f"request headers over {MAX_HEADER_BYTES} bytes")

    def _answering(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete


class _GuardedH11(_Guarded, H11Protocol):
    """h11 has no callbacks: after each read, and after each response (which may let a
    pipelined request be parsed), the client's state says whether a request is under way and
    its headers are not complete (IDLE with bytes buffered)."""

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_headers()

    def _follow_headers(self) -> None:
        if self.conn.their_state is not h11.IDLE:
            self._headers_end()
        elif self.conn.trailing_data[0]:
            self._headers_begin()

    def _answering(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete


def _too_many_connections(limit: int) -> bytes:
    return _raw_response(
        APIError(
            429,
            f"this client address already holds {limit} open connections to the server "
            "(--max-connections-per-client); reuse them (keep-alive) or close some",
            type=RATE_LIMIT,
            code="too_many_connections",
            headers=retry_later_headers(),
        )
    )


def _headers_too_slow(seconds: float) -> bytes:
    return _raw_response(
        APIError(
            408,
            f"the request's headers did not arrive within {seconds:g} s (--header-timeout)",
            code="request_timeout",
        )
    )


def _raw_response(err: APIError) -> bytes:
    """``err`` as an HTTP/1.1 response that closes the connection, written straight to the
    socket: no request was parsed that uvicorn could answer."""
    body = json.dumps(err.body(), ensure_ascii=True, separators=(",", ":")).encode("ascii")
    lines = [
        f"HTTP/1.1 {err.status} {http.HTTPStatus(err.status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *(f"{name.lower()}: {value}" for name, value in (err.headers or {}).items()),
    ]
    return "\r\n".join(lines).encode("ascii") + b"\r\n\r\n" + body
