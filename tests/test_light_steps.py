"""Light calls' steps between two layers of a long step (``Scheduler.schedule_light``,
``models.between_layers``, ``LocalPipeline._light_step``): a one-word request that arrives
while an encoder computes a long window waits for a layer of it, not for the window."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from test_shared_steps import batch, encoder_scheduler

import pipepool
from pipepool.core.digest import expected_digest
from pipepool.core.plan import StepPlan, StepResult
from pipepool.core.priority import client_turns
from pipepool.core.scheduler import Scheduler
from pipepool.driver.shared_steps import MEMORY_S, MIN_TOKENS, SharedSteps
from pipepool.models import bert as bert_model
from pipepool.stage import runner as stage_runner


def answer(plan: StepPlan) -> StepResult:
    """What a correct last stage returns for ``plan``: its state digest as expected, an output
    for every request (an encoder's requests finish in their step)."""
    return StepResult(
        step_id=plan.step_id,
        digest=expected_digest(plan.step_id, plan.expected_state, 1),
        vector_ids=plan.req_ids.copy(),
        vectors=plan.req_ids.astype(np.float32).reshape(-1, 1),
    )


def test_a_light_plan_takes_light_calls_of_other_clients_alone():
    s = encoder_scheduler(budget=64)
    s.add(batch(0, 60, 60, call=0))  # a long call: one prompt a step
    long_step = s.schedule()
    assert long_step is not None and long_step.req_ids.tolist() == [0]
    s.add(batch(2, 3, call=0))  # the long call's own small slice: keeps its order
    job = batch(3, 2)
    job.background = True
    s.add(job)  # background work: never in a light plan
    s.add(batch(4, 40))  # a call over the light bound
    s.add(batch(5, 3))  # light
    s.add(batch(6, 2, 2))  # light, two requests
    s.add(batch(8, 9))  # light, but over what is left of the budget
    light = s.schedule_light(light_tokens=16, max_tokens=8)
    assert light is not None
    assert light.req_ids.tolist() == [5, 6, 7], "light calls of other clients, whole, in order"
    assert light.num_tokens == 7
    assert s.schedule_light(light_tokens=16, max_tokens=8).req_ids.tolist() == [8], (
        "the first light call found always goes"
    )
    assert s.schedule_light(light_tokens=16, max_tokens=8) is None
    # Results come back out of order: the light plans finished inside the long step.
    for plan in (light,):
        s.update(plan, answer(plan), last_stage=0)
    s.update(long_step, answer(long_step), last_stage=0)
    rest = []
    while (plan := s.schedule()) is not None:
        s.update(plan, answer(plan), last_stage=0)
        rest += plan.req_ids.tolist()
    assert sorted(rest) == [1, 2, 3, 4], "every other request is planned once, as before"


def test_no_light_plan_for_causal_models():
    from pipepool.core.kv_blocks import BlockAllocator

    s = Scheduler(max_num_batched_tokens=64, max_num_seqs=8, chunked=True,
                  blocks=BlockAllocator(16, 16))  # fmt: skip
    with pytest.raises(AssertionError, match="causal"):
        s.schedule_light(light_tokens=16, max_tokens=64)


def test_a_light_call_served_between_layers_keeps_steps_short():
    steps = SharedSteps(2048, enabled=True)
    assert steps.short_tokens() == MIN_TOKENS, "no step timed yet"
    steps.timed(200, 0.02)
    short = steps.short_tokens()
    s = encoder_scheduler()
    s.add(batch(0, *[50] * 20))  # a large call, no light one waiting
    assert steps.budget(s, now=0.0) is None
    steps.light_served(now=1.0)
    assert steps.budget(s, now=1.0 + MEMORY_S / 2) == short
    assert steps.budget(s, now=1.0 + MEMORY_S) is None
    off = SharedSteps(2048, enabled=False)
    off.light_served(now=1.0)
    assert off.budget(s, now=1.5) is None


def test_light_calls_alone_keep_the_next_large_calls_steps_short():
    steps = SharedSteps(2048, enabled=True)
    steps.timed(200, 0.02)
    s = encoder_scheduler(budget=2048)
    s.add(batch(0, 3))
    s.add(batch(1, 2, 2, call=0))  # one light call (two slices), nothing else
    assert s.light_batches_of_one_call(steps.light_tokens) == 7
    assert steps.budget(s, now=0.0) is None, "nothing to cut"
    s.schedule()
    s.add(batch(3, *[100] * 20))  # a large call within MEMORY_S of it: short steps
    assert s.light_batches_of_one_call(steps.light_tokens) is None
    assert steps.budget(s, now=MEMORY_S / 2) == steps.short_tokens()
    assert steps.budget(s, now=MEMORY_S) is None, "no light call since: whole steps again"


def _after_one_clients_light_call() -> tuple[SharedSteps, Scheduler]:
    """Steps timed, and a scheduler whose one light call (client -5's) waited alone and was
    scheduled."""
    steps = SharedSteps(2048, enabled=True)
    steps.timed(200, 0.02)
    s = encoder_scheduler(budget=2048)
    s.add(batch(0, 10, call=-5))
    assert steps.budget(s, now=0.0) is None, "a light call alone"
    s.schedule()
    return steps, s


def test_one_clients_stream_of_light_requests_keeps_whole_steps():
    # A server's client takes one turn (``client_turns``): its one-text requests are one
    # call's light batches, which short steps would only split into more steps.
    steps, s = _after_one_clients_light_call()
    for i in range(40):
        s.add(batch(1 + i, 10, call=-5))
    assert s.light_batches_of_one_call(steps.light_tokens) == 400 > steps.light_tokens
    assert steps.short_tokens() < 400
    assert steps.budget(s, now=1.0) is None, "one client's light requests: nothing to cut"
    s.add(batch(41, 10))  # another client's light call beside them
    assert s.light_batches_of_one_call(steps.light_tokens) is None
    assert steps.budget(s, now=1.0) == steps.short_tokens()
    own = encoder_scheduler(budget=2048)
    own.add(batch(0, 10, call=-5))
    own.add(batch(1, 300, call=-5))  # the same client's large request
    assert own.light_batches_of_one_call(steps.light_tokens) is None
    assert steps.budget(own, now=1.0) == steps.short_tokens(), "light calls of two met at 1.0"


def test_a_light_calls_own_large_work_keeps_whole_steps():
    # Its light requests waited alone: a large request of the same client (the same turn)
    # after them holds up no one, so it is not cut; another client's is.
    steps, s = _after_one_clients_light_call()
    s.add(batch(1, *[100] * 20, call=-5))
    assert s.sole_call() == -5
    assert steps.budget(s, now=1.0) is None, "the same call's large work"
    s.add(batch(21, *[100] * 20, call=-6))
    assert s.sole_call() is None
    assert steps.budget(s, now=1.0) == steps.short_tokens(), "another call's, within MEMORY_S"


def test_one_calls_light_slices_are_counted_together():
    s = encoder_scheduler(budget=2048)
    s.add(batch(0, 100, call=7))
    s.add(batch(1, 100, call=7))
    assert s.light_batches_of_one_call(150) == 200, "200 tokens of one call: not one light call"
    assert s.light_batches_of_one_call(99) is None, "a slice over the light size"
    s.add(batch(2, 1))
    assert s.light_batches_of_one_call(200) is None, "two calls"


def test_the_cpu_busy_clock_counts_a_step_inside_another_once(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(stage_runner.time, "perf_counter", lambda: now[0])
    import torch

    clock = stage_runner.BusyClock(torch.device("cpu"))
    clock.start()
    now[0] = 1.0
    clock.start()  # a light step between two layers
    now[0] = 1.5
    clock.stop()
    now[0] = 3.0
    clock.stop()
    assert clock.seconds == 3.0


BUDGET = 64
LONG = " ".join(["a long window of words"] * 30)  # over BUDGET tokens: one step, alone
LIGHT = ["hi"]


@pytest.fixture(scope="module")
def engine(bert_path):
    with pipepool.Engine(str(bert_path), max_num_batched_tokens=BUDGET, dtype="float32") as e:
        assert e.pipeline._between_layers, "a CPU encoder computes its stage on the loop thread"
        # A tiny model's step is over in a few ms: light steps inside it may start at once.
        e.pipeline._shared_steps = SharedSteps(BUDGET, enabled=True, step_s=0.0)
        yield e


def _light_call_inside(engine, monkeypatch, first: list[str], first_client: str,
                       light_client: str) -> tuple[np.ndarray, dict]:  # fmt: skip
    """Submit ``first`` as ``first_client``; at the first layer boundary of its step, a light
    call of ``light_client`` arrives. Returns ``first``'s vectors and what was seen: the light
    call ("light") and whether it had finished before that step went on ("done inside")."""
    loop = engine.pipeline._thread
    armed = threading.Event()
    seen: dict = {}
    original = bert_model.between_layers

    def at_a_layer_boundary() -> None:
        if armed.is_set() and threading.current_thread() is loop and "light" not in seen:
            with client_turns(light_client):
                seen["light"] = light = engine.submit(LIGHT)
            original()  # the pipeline's hook: the light call's step, where it has one
            seen["done inside"] = light.done()
            return
        original()

    monkeypatch.setattr(bert_model, "between_layers", at_a_layer_boundary)
    with client_turns(first_client):
        armed.set()
        vectors = engine.submit(first).result(timeout=120)
    assert "light" in seen, "the step had a layer boundary"
    return vectors, seen


def test_a_light_call_is_computed_between_two_layers_of_a_long_step(engine, monkeypatch):
    alone_long, alone_light = engine.embed([LONG]), engine.embed(LIGHT)
    long_vectors, seen = _light_call_inside(engine, monkeypatch, [LONG], "long", "light")
    assert seen["done inside"] is True, "the light call finished inside the long step"
    assert np.array_equal(seen["light"].result(timeout=0), alone_light)
    assert np.array_equal(long_vectors, alone_long), "the long step resumed where it stopped"


def test_a_light_call_of_the_same_client_waits_for_its_long_step(engine, monkeypatch):
    _, seen = _light_call_inside(engine, monkeypatch, [LONG], "one client", "one client")
    assert seen["done inside"] is False, "a client's own calls keep their order"
    assert len(seen["light"].result(timeout=120)) == 1


def test_a_short_step_hosts_no_light_step(engine, monkeypatch):
    _, seen = _light_call_inside(engine, monkeypatch, LIGHT, "first", "light")
    assert seen["done inside"] is False, "it shares the next step with whatever else came"
    assert len(seen["light"].result(timeout=120)) == 1


def test_a_light_call_that_would_wait_at_most_step_s_waits_for_the_long_step(engine, monkeypatch):
    shared = engine.pipeline._shared_steps
    monkeypatch.setattr(shared, "step_s", 3600.0)
    monkeypatch.setattr(shared, "short_tokens", lambda: MIN_TOKENS)  # the long step is long
    _, seen = _light_call_inside(engine, monkeypatch, [LONG], "long", "light")
    assert seen["done inside"] is False, "the long step ends within step_s of its arrival"
    assert len(seen["light"].result(timeout=120)) == 1


def test_no_light_step_in_the_last_step_s_of_the_long_step(engine, monkeypatch):
    # At the speed measured the long step is over at once: a light call that arrives in it is
    # left for the next step at the boundary where it is seen, rather than have one of its own
    # (unless the step then runs late: the test below).
    monkeypatch.setattr(engine.pipeline._shared_steps, "seconds_per_token", 1e-12)
    monkeypatch.setattr(engine.pipeline._shared_steps, "short_tokens", lambda: MIN_TOKENS)
    _, seen = _light_call_inside(engine, monkeypatch, [LONG], "long", "light")
    assert seen["done inside"] is False
    assert len(seen["light"].result(timeout=120)) == 1


def test_a_light_call_gets_a_step_once_the_long_step_runs_past_its_expected_end(
    engine, monkeypatch
):
    # At the speed measured the long step is over at once, so the light call seen at its first
    # layer boundary is left for the next step; at the next boundary the step is still going
    # (it runs late: other work took the cores), and the light call, having waited, gets its
    # step there.
    monkeypatch.setattr(engine.pipeline._shared_steps, "seconds_per_token", 1e-12)
    monkeypatch.setattr(engine.pipeline._shared_steps, "short_tokens", lambda: MIN_TOKENS)
    loop = engine.pipeline._thread
    armed = threading.Event()
    seen: dict = {}
    original = bert_model.between_layers

    def at_a_layer_boundary() -> None:
        if not (armed.is_set() and threading.current_thread() is loop):
            original()
            return
        if "light" not in seen:
            with client_turns("light"):
                seen["light"] = engine.submit(LIGHT)
            original()
            seen["done at the first boundary"] = seen["light"].done()
        elif "done at a later boundary" not in seen:
            original()
            seen["done at a later boundary"] = seen["light"].done()
        else:
            original()

    monkeypatch.setattr(bert_model, "between_layers", at_a_layer_boundary)
    alone_light = engine.embed(LIGHT)
    with client_turns("long"):
        armed.set()
        engine.submit([LONG]).result(timeout=120)
    assert seen["done at the first boundary"] is False, "expected to end within step_s"
    assert seen["done at a later boundary"] is True, "the step ran late: the light call's turn"
    assert np.array_equal(seen["light"].result(timeout=0), alone_light)
