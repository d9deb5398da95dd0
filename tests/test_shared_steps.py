"""Short steps while light calls share a pipeline with large ones (``driver.shared_steps``):
the scheduler tells a light call waiting beside other work, the budget follows the measured
speed while that lasts, and a real pipeline cuts its steps then, and only then."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import MIN_COSINE, cosine

import pipepool
from pipepool.core.plan import StepPlan
from pipepool.core.priority import client_turns
from pipepool.core.request import PoolingParams, RequestBatch
from pipepool.core.scheduler import Scheduler
from pipepool.driver.shared_steps import MEMORY_S, MIN_TOKENS, STEP_S, SharedSteps

PARAMS = PoolingParams(pooling="mean")


def batch(first_id: int, *lens: int, call: int | None = None) -> RequestBatch:
    tokens = np.arange(sum(lens), dtype=np.int64) % 50 + 1
    made = RequestBatch(first_id, tokens, np.array(lens), PARAMS)
    if call is not None:
        made.call = call
    return made


def encoder_scheduler(budget: int = 64) -> Scheduler:
    return Scheduler(max_num_batched_tokens=budget, max_num_seqs=64, chunked=False, blocks=None)


def test_a_light_call_is_seen_only_beside_another_calls_work():
    s = encoder_scheduler()
    s.add(batch(0, *[8] * 20))  # a large call alone
    assert not s.light_call_waits(8)
    s.add(batch(20, 6, call=0))  # a small later slice of that same call: still one call
    assert not s.light_call_waits(8)
    s.add(batch(21, 2, 3))  # another call, small: light, beside the large one
    assert s.light_call_waits(8)
    assert not s.light_call_waits(4), "5 tokens are not light at 4, nor the slice's 6"
    s.schedule()  # every small call's rest fits its share: admitted, no longer waiting
    assert not s.light_call_waits(8)

    alone = encoder_scheduler()
    alone.add(batch(0, 2))
    assert not alone.light_call_waits(8), "a light call with nothing else to wait for"
    alone.add(batch(1, 40))
    assert alone.light_call_waits(8)


def test_a_partly_admitted_call_is_not_light_whatever_is_left_of_it():
    s = encoder_scheduler(budget=16)
    large, other = batch(0, *[8] * 5), batch(5, *[8] * 5)
    s.add(large)
    s.add(other)
    s.schedule()
    s.schedule()
    assert large.cursor and other.cursor  # both under way, each with more than 8 tokens left
    assert not s.light_call_waits(1000), "calls under way are not light, however little is left"
    s.add(batch(10, 8, 8, 8))
    assert not s.light_call_waits(23)
    assert s.light_call_waits(24), "a batch none of whose requests ran: light, up to 24 tokens"


def test_background_work_beside_a_light_call_counts_as_other_work():
    s = encoder_scheduler()
    job = batch(0, *[8] * 10)
    job.background = True
    s.add(job)
    s.add(batch(10, 2))
    assert s.light_call_waits(8)


def test_the_budget_is_short_while_light_calls_share_and_whole_otherwise():
    steps = SharedSteps(2048, enabled=True)
    assert steps.light_tokens == 256
    s = encoder_scheduler()
    s.add(batch(0, *[8] * 20))
    s.add(batch(20, 2))  # light, beside the large call
    assert steps.budget(s, now=0.0) is None, "no step timed yet: no speed to go by"
    steps.timed(32, 10.0)  # too short to say anything of a token's cost
    assert steps.seconds_per_token is None
    steps.timed(200, 0.02)  # 0.1 ms a token
    assert steps.budget(s, now=1.0) == round(STEP_S / 1e-4)
    s.schedule()  # the light call is admitted; steps stay short for MEMORY_S
    assert not s.light_call_waits(steps.light_tokens)
    assert steps.budget(s, now=1.0 + MEMORY_S / 2) == round(STEP_S / 1e-4)
    assert steps.budget(s, now=1.0 + MEMORY_S) is None
    steps.timed(100, 10.0)  # a slow host: never fewer than MIN_TOKENS
    s.add(batch(40, 1))
    assert steps.budget(s, now=5.0) == MIN_TOKENS


def test_pipelines_whose_steps_overlap_keep_their_budget():
    steps = SharedSteps(2048, enabled=False)
    steps.timed(200, 0.02)
    s = encoder_scheduler()
    s.add(batch(0, *[8] * 20))
    s.add(batch(20, 2))
    assert steps.seconds_per_token is None
    assert steps.budget(s, now=0.0) is None


class _PlanSpy:
    """Around a pipeline's scheduler: every plan's tokens and the budget it was given."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.plans: list[tuple[int | None, StepPlan]] = []
        self.scheduler = scheduler

    def __enter__(self) -> _PlanSpy:
        schedule = self.scheduler.schedule

        def spied(max_tokens: int | None = None) -> StepPlan | None:
            plan = schedule(max_tokens)
            if plan is not None:
                self.plans.append((max_tokens, plan))
            return plan

        self.scheduler.schedule = spied  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc) -> None:
        del self.scheduler.schedule  # the class's method again


BUDGET = 512
LARGE = [f"document {i}: " + "a longer text of the large call " * 2 for i in range(400)]
LIGHT = ["a one-word query"]


@pytest.fixture(scope="module")
def engine(bert_path):
    with pipepool.Engine(str(bert_path), max_num_batched_tokens=BUDGET, dtype="float32") as e:
        # Whatever this host's speed, a step while light calls share holds MIN_TOKENS (or one
        # prompt): a step of no time at all is wanted.
        assert e.pipeline._shared_steps.enabled, "CPU steps do not overlap"
        e.pipeline._shared_steps = SharedSteps(BUDGET, enabled=True, step_s=0.0)
        yield e


def test_a_pipeline_cuts_its_steps_while_a_light_call_shares_it(engine):
    with _PlanSpy(engine.pipeline._scheduler) as spy:
        engine.embed(LARGE[:100])  # timed steps: a speed to go by
        spy.plans.clear()
        with client_turns("large"):
            large = engine.submit(LARGE)  # 16 steps of the whole budget, alone
        with client_turns("light"):
            light = engine.submit(LIGHT)
        light_vectors = light.result(timeout=120)
        # Turns: the light call had the next step; the large one had many more to go.
        assert not large.done()
        large_vectors = large.result(timeout=300)
    budgets = [budget for budget, _ in spy.plans]
    assert MIN_TOKENS in budgets, "steps were cut once the light call waited beside it"
    first_cut = budgets.index(MIN_TOKENS)
    assert set(budgets[:first_cut]) <= {None}
    for budget, plan in spy.plans[first_cut:]:
        assert budget == MIN_TOKENS, "short for MEMORY_S after the light call"
        assert plan.num_tokens <= MIN_TOKENS or len(plan.req_ids) == 1
    assert cosine(large_vectors, engine.embed(LARGE)).min() >= MIN_COSINE
    assert cosine(light_vectors, engine.embed(LIGHT)).min() >= MIN_COSINE


def test_a_large_call_alone_and_calls_of_one_client_keep_whole_steps(engine):
    engine.pipeline._shared_steps._shared_until = float("-inf")  # the last test's sharing over
    with _PlanSpy(engine.pipeline._scheduler) as spy, client_turns("one client"):
        calls = [engine.submit(LARGE), engine.submit(LIGHT)]
        for call in calls:
            call.result(timeout=300)
    assert spy.plans and {budget for budget, _ in spy.plans} == {None}
    assert max(plan.num_tokens for _, plan in spy.plans) > BUDGET // 2
