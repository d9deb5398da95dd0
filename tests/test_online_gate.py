"""``server.online_gate``: while an online request is in flight, a background event loop takes no
task step and a background pool runs no call (at most ``max_wait_s`` each); between online
requests they run; the middleware counts online requests only, never a batch line's."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from fastapi import FastAPI

from pipepool.core.priority import background_work
from pipepool.server.online_gate import (
    BACKGROUND_SHARE,
    SETTLED_S,
    BackgroundPool,
    OnlineGate,
    OnlineRequests,
    gated_task_factory,
)

TIMEOUT_S = 30


class WatchedGate(OnlineGate):
    """Says (``held``) when a background thread is about to wait for online requests."""

    def __init__(self, max_wait_s: float) -> None:
        super().__init__(max_wait_s)
        self.held = threading.Event()

    def wait_for_quiet(self) -> None:
        if self.online:
            self.held.set()
        super().wait_for_quiet()


class BackgroundLoop:
    """A gated event loop on a thread of its own, running a task that counts its steps."""

    def __init__(self, gate: OnlineGate) -> None:
        self.steps = 0
        self.reached: dict[int, threading.Event] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(gate,), daemon=True)
        self._thread.start()

    def wait_for(self, steps: int) -> None:
        event = self.reached.setdefault(steps, threading.Event())
        if self.steps < steps:
            assert event.wait(TIMEOUT_S), f"the background task took {self.steps} of {steps} steps"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(TIMEOUT_S)

    def _run(self, gate: OnlineGate) -> None:
        loop = asyncio.new_event_loop()
        loop.set_task_factory(gated_task_factory(gate))
        with asyncio.Runner(loop_factory=lambda: loop) as runner:
            runner.run(self._count())

    async def _count(self) -> None:
        while not self._stop.is_set():
            self.steps += 1
            for steps, event in list(self.reached.items()):
                if self.steps >= steps:
                    event.set()
            await asyncio.sleep(0)


def test_quiet_for_counts_from_the_end_of_the_last_online_request():
    now = [100.0]
    gate = OnlineGate(clock=lambda: now[0])
    now[0] += 2
    assert gate.quiet_for(1.0)
    with gate.online_request():
        assert not gate.quiet() and not gate.quiet_for(0.0)
        now[0] += 5  # however long it is in flight
        assert not gate.quiet_for(1.0)
    assert gate.quiet() and gate.quiet_for(0.0) and not gate.quiet_for(1.0)
    now[0] += 0.5
    assert not gate.quiet_for(1.0)
    now[0] += 0.5
    assert gate.quiet_for(1.0) and gate.settled() == gate.quiet_for(SETTLED_S)


def test_a_background_loop_takes_no_step_while_an_online_request_is_in_flight():
    gate = WatchedGate(max_wait_s=TIMEOUT_S)
    background = BackgroundLoop(gate)
    try:
        background.wait_for(10)
        with gate.online_request():
            assert gate.held.wait(TIMEOUT_S)  # its thread now waits in the gate
            held_at = background.steps
            assert background.steps == held_at
        background.wait_for(held_at + 10)  # and goes on once the request is answered
    finally:
        background.stop()


def test_a_background_loop_still_moves_under_online_requests_that_never_pause():
    gate = OnlineGate(max_wait_s=0.01)
    background = BackgroundLoop(gate)
    try:
        with gate.online_request():
            background.wait_for(5)  # each step waited 10 ms at most
    finally:
        background.stop()


def test_under_online_requests_that_never_pause_background_work_has_its_turn():
    """A wait that online requests never let end early gives background work its turn: for
    ``BACKGROUND_SHARE`` of the time (after a wait of ``max_wait_s``) it waits for nothing."""
    now = [0.0]
    gate = OnlineGate(max_wait_s=0.01, clock=lambda: now[0])
    waits: list[float] = []
    wait_for = gate._quiet.wait_for

    def counted(predicate, timeout):
        waits.append(timeout)
        return wait_for(predicate, timeout)

    gate._quiet.wait_for = counted  # type: ignore[method-assign]
    turn = 0.01 * BACKGROUND_SHARE / (1 - BACKGROUND_SHARE)  # 1.1 ms after each 10 ms
    with gate.online_request():
        gate.wait_for_quiet()
        assert waits == [0.01]
        now[0] += 0.99 * turn
        gate.wait_for_quiet()  # its turn: at once
        assert waits == [0.01]
        now[0] += 0.02 * turn
        gate.wait_for_quiet()  # the turn is over: it waits again
        assert waits == [0.01, 0.01]
    now[0] = 0.0  # no online request in flight: no wait, turn or not
    gate.wait_for_quiet()
    assert waits == [0.01, 0.01]


def test_a_background_pool_runs_no_call_while_an_online_request_is_in_flight():
    gate = WatchedGate(max_wait_s=TIMEOUT_S)
    with BackgroundPool(1, thread_name_prefix="test-background", gate=gate) as pool:
        with gate.online_request():
            done = pool.submit(lambda x: x * 2, 21)
            assert gate.held.wait(TIMEOUT_S)
            assert not done.done()
        assert done.result(TIMEOUT_S) == 42


@pytest.mark.parametrize("background", [False, True])
def test_the_middleware_counts_online_requests_only(background):
    gate = OnlineGate()
    app = FastAPI()
    seen = []

    @app.get("/probe")
    async def probe():
        seen.append(gate.online)
        return {}

    async def call():
        transport = httpx.ASGITransport(app=OnlineRequests(app, gate))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            if background:
                with background_work():
                    return await client.get("/probe")
            return await client.get("/probe")

    assert asyncio.run(call()).status_code == 200
    assert seen == [0 if background else 1]
    assert gate.online == 0
