"""Issue 2 acceptance: the scheduler's policy, driven without a model.

A fake pipeline answers each plan the way a correct last stage would (digest = plan.ends,
an output for every request whose final chunk the plan holds), keeping up to ``depth``
plans in flight like the engine loop does. Every plan is checked against the invariants
that keep the stages in lockstep: token budget, request cap, FIFO admission, chunks that
tile each prompt exactly, and KV blocks that all come back.
"""

from __future__ import annotations

import itertools
from collections import deque

import numpy as np
import pytest
from tiny_models import cosine, long_prompts

import pipepool
from pipepool.kv_blocks import BlockAllocator
from pipepool.plan import StepPlan, StepResult
from pipepool.request import PoolingParams, Request, RequestStatus
from pipepool.scheduler import Scheduler

PARAMS = PoolingParams(pooling="mean")


def make_request(request_id: int, prompt_len: int) -> Request:
    return Request(request_id, np.arange(prompt_len, dtype=np.int64) % 97, PARAMS)


def make_scheduler(
    budget: int, max_seqs: int, *, chunked: bool = True, num_blocks: int = 1024, block_size=4
) -> Scheduler:
    blocks = BlockAllocator(num_blocks, block_size) if chunked else None
    return Scheduler(
        max_num_batched_tokens=budget, max_num_seqs=max_seqs, chunked=chunked, blocks=blocks
    )


def answer(plan: StepPlan, prompt_lens: dict[int, int]) -> StepResult:
    """What a correct last stage returns: every request advanced to its chunk end."""
    outputs = {
        rid: np.array([rid], dtype=np.float32)
        for rid, end in zip(plan.req_ids.tolist(), plan.ends.tolist(), strict=True)
        if end == prompt_lens[rid]
    }
    return StepResult(step_id=plan.step_id, digest=plan.ends.copy(), outputs=outputs)


class Tracker:
    """Checks every plan as it is produced and records how each prompt was cut."""

    def __init__(
        self, scheduler: Scheduler, prompt_lens: dict[int, int], *, encoder: bool = False
    ) -> None:
        self.scheduler = scheduler
        self.encoder = encoder  # whole prompts; one over the budget runs alone
        self.prompt_lens = prompt_lens
        self.arrival: list[int] = []  # request ids in the order they were added
        self.chunks: dict[int, list[tuple[int, int]]] = {}
        self.finished: dict[int, np.ndarray] = {}
        self.aborted: set[int] = set()
        self.plans = 0

    def add(self, request: Request) -> None:
        self.scheduler.add(request)
        self.arrival.append(request.request_id)

    def check(self, plan: StepPlan) -> None:
        s = self.scheduler
        self.plans += 1
        oversized_alone = (
            self.encoder and plan.num_reqs == 1 and plan.num_tokens > s.max_num_batched_tokens
        )
        if not oversized_alone:
            assert plan.num_tokens <= s.max_num_batched_tokens, "token budget exceeded"
        assert plan.num_reqs <= s.max_num_seqs, "max_num_seqs exceeded"
        assert plan.num_tokens == int((plan.ends - plan.starts).sum())
        new_ids = {n.request_id for n in plan.new_requests}
        for rid, start, end in zip(
            plan.req_ids.tolist(), plan.starts.tolist(), plan.ends.tolist(), strict=True
        ):
            assert rid not in self.aborted, f"aborted request {rid} scheduled again"
            previous = self.chunks.setdefault(rid, [])
            expected_start = previous[-1][1] if previous else 0
            assert start == expected_start, f"request {rid}: chunk starts at {start}"
            assert start < end <= self.prompt_lens[rid]
            assert (rid in new_ids) == (start == 0), "prompt tokens sent exactly once"
            if self.encoder:
                assert (start, end) == (0, self.prompt_lens[rid]), "encoders never chunk"
            if start == 0:
                # FIFO: everyone who arrived earlier got a first chunk already (or was
                # aborted while waiting); within a plan, in arrival order too.
                earlier = self.arrival[: self.arrival.index(rid)]
                overtaken = [r for r in earlier if r not in self.chunks and r not in self.aborted]
                assert not overtaken, f"request {rid} started before {overtaken}"
                assert np.array_equal(plan.new_token_ids[rid], s.requests[rid].token_ids)
                if s.blocks is not None:
                    # KV blocks for the whole prompt, only when it is split across steps.
                    new = next(n for n in plan.new_requests if n.request_id == rid)
                    chunked = end < self.prompt_lens[rid]
                    wanted = s.blocks.blocks_for(self.prompt_lens[rid]) if chunked else 0
                    assert len(new.block_ids) == wanted
            previous.append((start, end))

    def collect(self, plan: StepPlan) -> None:
        finished = self.scheduler.update(plan, answer(plan, self.prompt_lens), last_stage=0)
        for request in finished:
            assert request.status == RequestStatus.FINISHED
            assert request.num_computed_tokens == request.prompt_len
            assert request.request_id not in self.finished
            self.finished[request.request_id] = request.output

    def assert_tiled(self, rid: int) -> None:
        """The chunks of a finished request cover [0, prompt_len) in order, no gap/overlap."""
        chunks = self.chunks[rid]
        assert chunks[0][0] == 0 and chunks[-1][1] == self.prompt_lens[rid]
        for (_, end), (start, _) in itertools.pairwise(chunks):
            assert start == end


def run(
    tracker: Tracker,
    *,
    depth: int = 1,
    inflight: deque[StepPlan] | None = None,
    max_plans: int = 100_000,
) -> None:
    """Drive the scheduler to completion with up to ``depth`` plans in flight (continuing
    with ``inflight``, the plans a test already submitted)."""
    s = tracker.scheduler
    inflight = deque() if inflight is None else inflight
    while s.has_schedulable() or inflight:
        while len(inflight) < depth:
            plan = s.schedule()
            if plan is None:
                break
            tracker.check(plan)
            inflight.append(plan)
        assert inflight, "nothing schedulable and nothing in flight: the scheduler is stuck"
        tracker.collect(inflight.popleft())
        assert tracker.plans < max_plans


@pytest.mark.parametrize("budget", [1, 7, 16, 64])
@pytest.mark.parametrize("max_seqs", [1, 3, 256])
def test_chunked_budget_seqs_fifo_and_tiling_hold_for_random_prompt_mixes(budget, max_seqs):
    rng = np.random.default_rng(1000 * budget + max_seqs)
    for trial in range(25):
        s = make_scheduler(budget, max_seqs, num_blocks=int(rng.integers(40, 200)))
        lens = rng.integers(1, 120, size=int(rng.integers(1, 12))).tolist()
        prompt_lens = dict(enumerate(lens))
        t = Tracker(s, prompt_lens)
        for rid, n in prompt_lens.items():
            t.add(make_request(rid, n))
        run(t, depth=int(rng.integers(1, 5)))
        assert sorted(t.finished) == sorted(prompt_lens), f"trial {trial}"
        for rid in prompt_lens:
            t.assert_tiled(rid)
            assert t.finished[rid][0] == rid  # each output went to its own request
        assert s.blocks.num_free == s.blocks.num_blocks, "KV blocks leaked"
        assert not s.requests and not s.waiting and not s.running


def test_requests_arriving_between_steps_keep_fifo_and_budget():
    rng = np.random.default_rng(7)
    for budget in (1, 7, 33):
        s = make_scheduler(budget, 4, num_blocks=60)
        prompt_lens: dict[int, int] = {}
        t = Tracker(s, prompt_lens)
        inflight: deque[StepPlan] = deque()
        next_id = 0
        for _ in range(300):
            for _ in range(int(rng.integers(0, 3))):
                prompt_lens[next_id] = int(rng.integers(1, 90))
                t.add(make_request(next_id, prompt_lens[next_id]))
                next_id += 1
            plan = s.schedule()
            if plan is not None:
                t.check(plan)
                inflight.append(plan)
            if inflight and (len(inflight) >= 3 or rng.random() < 0.5):
                t.collect(inflight.popleft())
        run(t, depth=3, inflight=inflight)
        assert sorted(t.finished) == list(range(next_id))
        for rid in prompt_lens:
            t.assert_tiled(rid)
        assert s.blocks.num_free == s.blocks.num_blocks


def test_long_prompt_is_split_into_budget_sized_chunks():
    s = make_scheduler(16, 8)
    t = Tracker(s, {0: 50})
    t.add(make_request(0, 50))
    run(t)
    assert t.chunks[0] == [(0, 16), (16, 32), (32, 48), (48, 50)]


def test_next_chunk_is_planned_while_previous_chunk_is_in_flight():
    s = make_scheduler(8, 8)
    s.add(make_request(0, 20))
    plans = [s.schedule() for _ in range(3)]
    assert [(int(p.starts[0]), int(p.ends[0])) for p in plans] == [(0, 8), (8, 16), (16, 20)]
    assert s.schedule() is None
    for plan in plans:
        s.update(plan, answer(plan, {0: 20}), last_stage=0)
    assert not s.requests and s.blocks.num_free == s.blocks.num_blocks


def test_aborts_of_waiting_running_and_scheduled_requests_return_every_block():
    s = make_scheduler(8, 2, num_blocks=16, block_size=4)
    prompt_lens = {0: 30, 1: 12, 2: 10, 3: 5, 4: 9}
    t = Tracker(s, prompt_lens)
    for rid, n in prompt_lens.items():
        t.add(make_request(rid, n))
    first = s.schedule()  # request 0: tokens [0, 8), request 0 is RUNNING
    t.check(first)
    assert first.req_ids.tolist() == [0]
    assert s.requests[0].status == RequestStatus.RUNNING
    assert s.blocks.num_free == 16 - 8  # the whole prompt's blocks, at admission

    # Abort a waiting request: it never appears in a plan and never held blocks.
    assert s.abort(3).status == RequestStatus.ABORTED
    t.aborted.add(3)
    assert s.blocks.num_free == 8

    # Abort the running request while its first chunk is still in flight.
    assert s.abort(0).status == RequestStatus.ABORTED
    t.aborted.add(0)
    assert s.blocks.num_free == 16, "a running request's blocks return at abort"

    second = s.schedule()
    t.check(second)
    assert second.freed_ids == (0,), "the stages are told to drop the aborted request"
    assert second.req_ids.tolist() == [1]  # 12 tokens: [0, 8)
    third = s.schedule()
    t.check(third)
    assert third.req_ids.tolist() == [1, 2]  # request 1 ends, request 2 starts
    assert s.requests[1].status == RequestStatus.SCHEDULED

    # Abort a fully scheduled request: its blocks came back when its final chunk was planned.
    free_before = s.blocks.num_free
    assert s.abort(1).status == RequestStatus.ABORTED
    t.aborted.add(1)
    assert s.blocks.num_free == free_before
    assert s.abort(1) is None, "aborting twice is a no-op"
    assert s.abort(12345) is None

    # Results of the aborted requests' chunks still come back; they are ignored.
    for plan in (first, second, third):
        t.collect(plan)
    assert 0 not in t.finished and 1 not in t.finished
    run(t, depth=2)
    assert sorted(t.finished) == [2, 4]
    assert s.blocks.num_free == s.blocks.num_blocks
    assert not s.has_schedulable() and not s.requests


def test_random_aborts_never_leak_blocks():
    rng = np.random.default_rng(3)
    for trial in range(40):
        budget = int(rng.choice([1, 7, 16, 40]))
        s = make_scheduler(budget, int(rng.integers(1, 6)), num_blocks=50, block_size=4)
        prompt_lens = {rid: int(n) for rid, n in enumerate(rng.integers(1, 100, size=10))}
        t = Tracker(s, prompt_lens)
        for rid, n in prompt_lens.items():
            t.add(make_request(rid, n))
        inflight: deque[StepPlan] = deque()
        while s.has_schedulable() or inflight:
            if rng.random() < 0.15 and s.requests:
                rid = int(rng.choice(sorted(s.requests)))
                s.abort(rid)
                t.aborted.add(rid)
            plan = s.schedule() if len(inflight) < 3 else None
            if plan is not None:
                t.check(plan)
                inflight.append(plan)
            elif inflight:
                t.collect(inflight.popleft())
        assert set(t.finished) | t.aborted == set(prompt_lens), f"trial {trial}"
        assert not set(t.finished) & t.aborted
        assert s.blocks.num_free == s.blocks.num_blocks, f"trial {trial}: KV blocks leaked"


def test_request_waits_for_blocks_and_proceeds_when_they_return():
    s = make_scheduler(10, 8, num_blocks=4, block_size=4)  # 16 tokens of KV in all
    prompt_lens = {0: 12, 1: 12, 2: 3}
    t = Tracker(s, prompt_lens)
    for rid, n in prompt_lens.items():
        t.add(make_request(rid, n))
    plans = []
    for expected in ([0], [0], [1], [1, 2]):
        plan = s.schedule()
        t.check(plan)
        assert plan.req_ids.tolist() == expected
        plans.append(plan)
        if len(plans) == 2:
            # Request 1 (chunked) needs 3 blocks, request 0 holds 3 of 4 until this plan is
            # built: request 1 waits, and request 2 (whole, no blocks) may not overtake it.
            assert [r.request_id for r in s.waiting] == [1, 2]
    for plan in plans:
        t.collect(plan)
    assert sorted(t.finished) == [0, 1, 2]
    assert s.blocks.num_free == 4


def test_blocks_held_by_a_partly_scheduled_prompt_make_the_queue_wait():
    s = make_scheduler(6, 8, num_blocks=4, block_size=4)
    t = Tracker(s, {0: 16, 1: 8})
    t.add(make_request(0, 16))  # chunks 6, 6, 4: holds all 4 blocks until its final chunk
    t.add(make_request(1, 8))  # would start with 2 tokens in plan 3, but has no blocks yet
    plans = []
    for expected in ([0], [0], [0], [1], [1]):
        plan = s.schedule()
        t.check(plan)
        assert plan.req_ids.tolist() == expected
        plans.append(plan)
    for plan in plans:
        t.collect(plan)
    assert s.blocks.num_free == 4


@pytest.mark.parametrize("budget", [1, 7, 16])
def test_encoder_mode_schedules_whole_prompts_and_oversized_ones_alone(budget):
    rng = np.random.default_rng(budget)
    for trial in range(30):
        s = make_scheduler(budget, int(rng.integers(1, 8)), chunked=False)
        prompt_lens = {rid: int(n) for rid, n in enumerate(rng.integers(1, 40, size=12))}
        t = Tracker(s, prompt_lens, encoder=True)
        for rid, n in prompt_lens.items():
            t.add(make_request(rid, n))
        run(t, depth=int(rng.integers(1, 4)))
        assert sorted(t.finished) == sorted(prompt_lens), f"trial {trial}"
        for rid, n in prompt_lens.items():
            assert t.chunks[rid] == [(0, n)], "encoders never chunk"
        assert any(n > budget for n in prompt_lens.values())


def test_encoder_prompt_over_budget_waits_for_an_empty_step():
    s = make_scheduler(10, 8, chunked=False)
    prompt_lens = {0: 4, 1: 25, 2: 3}
    t = Tracker(s, prompt_lens, encoder=True)
    for rid, n in prompt_lens.items():
        t.add(make_request(rid, n))
    plans = [s.schedule() for _ in range(3)]
    assert [p.req_ids.tolist() for p in plans] == [[0], [1], [2]]
    assert [p.num_tokens for p in plans] == [4, 25, 3]
    assert s.schedule() is None
    for plan in plans:
        t.check(plan)
        t.collect(plan)
    assert sorted(t.finished) == [0, 1, 2]


def test_update_rejects_a_digest_that_disagrees_with_the_plan():
    s = make_scheduler(8, 8)
    s.add(make_request(0, 20))
    s.add(make_request(1, 3))
    plan = s.schedule()
    assert plan.req_ids.tolist() == [0] and plan.ends.tolist() == [8]
    # The historical bug: a stage that never advanced reports a stale count.
    stale = StepResult(step_id=plan.step_id, digest=np.array([0]), outputs={})
    with pytest.raises(pipepool.StateDivergence, match=r"step 0.*request 0.*expected 8, found 0"):
        s.update(plan, stale, last_stage=1)
    short = StepResult(step_id=plan.step_id, digest=np.empty(0, dtype=np.int64), outputs={})
    with pytest.raises(pipepool.StateDivergence, match="request 0"):
        s.update(plan, short, last_stage=1)
    wrong_step = StepResult(step_id=plan.step_id + 5, digest=plan.ends, outputs={})
    with pytest.raises(pipepool.StateDivergence, match="step id expected 0, found 5"):
        s.update(plan, wrong_step, last_stage=1)
    assert s.requests[0].num_computed_tokens == 0, "a rejected result changes nothing"
    s.update(plan, answer(plan, {0: 20}), last_stage=1)
    assert s.requests[0].num_computed_tokens == 8


# -- end to end: the engine's results do not depend on arrival order ------------------------


@pytest.fixture(scope="module")
def qwen3_engine(qwen3_path):
    with pipepool.Engine(str(qwen3_path), max_num_batched_tokens=24, max_num_seqs=4) as engine:
        yield engine


def test_results_independent_of_arrival_order(qwen3_engine):
    engine = qwen3_engine
    prompts = long_prompts()
    reference = engine.embed(prompts)
    chunked_before = engine.stats.chunked_requests
    rng = np.random.default_rng(0)
    for _ in range(4):
        order = rng.permutation(len(prompts))
        # One submit per prompt: each arrives separately, so FIFO order, chunk boundaries and
        # batch company all change with the permutation.
        futures = [engine.submit([prompts[i]])[0] for i in order]
        vectors = np.stack([f.result() for f in futures])
        by_prompt = np.empty_like(vectors)
        by_prompt[order] = vectors
        assert cosine(by_prompt, reference).min() >= 0.99999
    assert engine.stats.chunked_requests > chunked_before, "the budget never forced chunking"
