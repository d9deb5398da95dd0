"""A request the engine refuses or fails leaves no reference cycle in the front end: what it
held (its body too) is freed when its answer is sent, not at the collector's next full pass,
which a flood of refused requests made pause every model's requests (issue 35)."""

from __future__ import annotations

import asyncio
import gc
from types import SimpleNamespace

import pytest

from pipepool.errors import InvalidInputError
from pipepool.server.awaiting import Awaiting
from pipepool.server.errors import APIError
from pipepool.server.front import QueueFullError
from pipepool.server.routes.shared import unless_client_leaves


def _request() -> SimpleNamespace:
    """What ``unless_client_leaves`` reads of a request: its model's front and its receive."""

    async def receive() -> dict:
        await asyncio.Event().wait()  # the client never leaves
        return {"type": "http.disconnect"}

    front = SimpleNamespace(awaiting=Awaiting())
    return SimpleNamespace(state=SimpleNamespace(pipepool_model=SimpleNamespace(front=front)),
                           receive=receive)  # fmt: skip


async def _answer(make_error) -> tuple[type, int | None]:
    """What the route raises when the engine call raises ``make_error()``: (type, status)."""

    async def work() -> None:
        raise make_error()  # made here: a closure holding it would be a cycle of the test's

    try:
        await unless_client_leaves(_request(), work())
    except Exception as exc:
        return type(exc), getattr(exc, "status", None)
    raise AssertionError("the route returned")


# Each error made inside the test: one the parametrization held would be reachable anyway.
@pytest.mark.parametrize(
    ("make_error", "expected"),
    [
        (lambda: QueueFullError("the server has 16384 inputs in progress"), (APIError, 429)),
        (lambda: InvalidInputError("input 3 is empty", param="input"), (APIError, 400)),
        (lambda: RuntimeError("a bug"), (RuntimeError, None)),
    ],
    ids=["queue-full", "engine-error", "other"],
)
def test_a_refused_or_failed_request_leaves_no_reference_cycle(make_error, expected):
    kinds = (QueueFullError, InvalidInputError, RuntimeError, APIError)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds unreachable stays in gc.garbage
    try:
        assert asyncio.run(_answer(make_error)) == expected
        gc.collect()
        cyclic = [type(o).__name__ for o in gc.garbage if isinstance(o, kinds)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert cyclic == []
