"""A client that sends a large request again the moment it is refused gets a bounded share of
the server's process, not all of it.

A request is refused after its body is parsed: a TEI ``/tokenize`` of 100,000 inputs (2.4 MB
of JSON, over --max-inputs-per-request) holds the interpreter's lock for ~20 ms of parsing
before its 413, and the whole process waits meanwhile: the event loop's other requests, and the
engine's steps, which take the lock between their ops. One client sending it again as soon as
answered kept the process parsing most of the time, and the light clients' slowest requests
waited for several such parses in a row (issue 57). So the answer to a refused request (any
4xx but 429, which ``--queue-wait`` paces already) whose body had at least
``PACED_BODY_BYTES`` is held ``PACE`` times what the server spent on it, from the body read to
the answer: a client that sends again when answered takes at most 1 / (1 + ``PACE``) of the
process on its connection. An honest client's one such mistake costs it under a second.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from ..core.priority import is_background

# A body at least this large takes milliseconds to parse and check (a refusal of a smaller one
# costs about what any request costs, and is not held).
PACED_BODY_BYTES = 256 << 10
# The answer to a refused large request waits this many times the server's time on it. At 3,
# the 100,000-input /tokenize client of issue 57 kept the process parsing a quarter of the
# time, and the light clients' p99 beside all three hostile loads was 66-83 ms on 2 CPU cores;
# at 30, 61-65 ms, and the other hostile clients embedded ~40% more meanwhile
# (docs/benchmarks/http-server.md, "Refusals held longer").
PACE = 30.0
# The longest an answer is held, however long the request took.
MAX_HOLD_S = 1.0


def held_for(status: int, body_bytes: int, spent_s: float) -> float:
    """Seconds the answer to a request is held: ``PACE`` times ``spent_s`` (at most
    ``MAX_HOLD_S``) for a refusal (4xx but 429) of a body of at least ``PACED_BODY_BYTES``;
    else 0."""
    refused = 400 <= status < 500 and status != 429
    if not refused or body_bytes < PACED_BODY_BYTES:
        return 0.0
    return min(MAX_HOLD_S, PACE * max(0.0, spent_s))


class RefusalPacing:
    """ASGI middleware, inside the guards that read the body (``guards.GuardMiddleware``):
    counts the body the app reads and the time from its call to the answer's start, and holds
    that start ``held_for`` seconds. Background work (batch lines) is never held."""

    def __init__(
        self,
        app,
        *,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        self.app = app
        self._clock = clock
        self._sleep = sleep

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or is_background():
            await self.app(scope, receive, send)
            return
        started = self._clock()
        size = 0

        async def counted():
            nonlocal size
            message = await receive()
            size += len(message.get("body", b""))
            return message

        async def paced(message) -> None:
            if message["type"] == "http.response.start":
                hold = held_for(message["status"], size, self._clock() - started)
                if hold > 0:
                    await self._sleep(hold)
            await send(message)

        await self.app(scope, counted, paced)
