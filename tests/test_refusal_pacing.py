"""Refusals of large bodies held in proportion to what they cost (``server.refusal_pacing``):
a client that resends a refused 2.4 MB request at once gets a bounded share of the process.
The clock and the sleep are the test's: nothing here is timed."""

from __future__ import annotations

import asyncio

import pytest

from pipepool.core.priority import background_work
from pipepool.server.refusal_pacing import (
    MAX_HOLD_S,
    PACE,
    PACED_BODY_BYTES,
    RefusalPacing,
    held_for,
)

LARGE = PACED_BODY_BYTES
SMALL = PACED_BODY_BYTES - 1


def test_only_refusals_of_large_bodies_are_held():
    assert held_for(413, LARGE, 0.02) == pytest.approx(PACE * 0.02)
    assert held_for(400, LARGE, 0.01) == pytest.approx(PACE * 0.01)
    assert held_for(422, 10 * LARGE, 0.01) == pytest.approx(PACE * 0.01)
    assert held_for(413, SMALL, 0.02) == 0, "a small body's refusal costs what any request does"
    assert held_for(200, LARGE, 0.5) == 0, "answers are never held"
    assert held_for(429, LARGE, 0.5) == 0, "--queue-wait paces 429s"
    assert held_for(500, LARGE, 0.5) == 0, "the server's own failures are not the client's"
    assert held_for(413, LARGE, 60.0) == MAX_HOLD_S


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _app(status: int, clock: _Clock, spends: float):
    """An ASGI app that reads the body, spends ``spends`` seconds of ``clock`` and answers."""

    async def app(scope, receive, send) -> None:
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        clock.now += spends
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    return app


def _call(status: int, body_bytes: int, *, spends: float = 0.02) -> tuple[list[float], list]:
    """Run one request of ``body_bytes`` (in two parts) through the middleware: the holds it
    asked for, and what reached the client, in order (holds as ("hold", seconds))."""
    clock, events = _Clock(), []

    async def sleep(seconds: float) -> None:
        events.append(("hold", seconds))

    parts = [
        {"type": "http.request", "body": b"x" * (body_bytes // 2), "more_body": True},
        {"type": "http.request", "body": b"x" * (body_bytes - body_bytes // 2)},
    ]

    async def receive():
        return parts.pop(0)

    async def send(message) -> None:
        events.append(message["type"])

    paced = RefusalPacing(_app(status, clock, spends), clock=clock, sleep=sleep)
    asyncio.run(paced({"type": "http"}, receive, send))
    holds = [e[1] for e in events if isinstance(e, tuple)]
    return holds, events


def test_the_answer_to_a_refused_large_body_starts_after_the_hold():
    holds, events = _call(413, LARGE, spends=0.02)
    assert holds == [pytest.approx(PACE * 0.02)]
    assert events == [("hold", holds[0]), "http.response.start", "http.response.body"]


def test_other_answers_go_at_once():
    assert _call(200, LARGE)[0] == []
    assert _call(413, SMALL)[0] == []
    assert _call(429, LARGE)[0] == []


def test_background_work_is_never_held():
    with background_work():
        assert _call(413, LARGE)[0] == []
