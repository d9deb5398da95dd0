"""Issue 2 acceptance: the scheduler's policy, driven without a model.

A fake pipeline answers each plan the way a correct last stage would (the digest chain the
plan expects, an output for every request whose final chunk the plan holds), keeping up to ``depth``
plans in flight like the engine loop does. Every plan is checked against the invariants
that keep the stages in lockstep: token budget, request cap, fair admission (calls start in
arrival order unless small enough to go in whole, each batch's requests in its order, online
before background and never in the same step), chunks that tile each prompt exactly, the
right tokens for each chunk, and KV blocks that all come back.
"""

from __future__ import annotations

import itertools
from collections import deque

import numpy as np
import pytest
from tiny_models import cosine, long_prompts

import pipepool
from pipepool.core.digest import Digest, expected_digest
from pipepool.core.kv_blocks import BlockAllocator
from pipepool.core.plan import StepPlan, StepResult
from pipepool.core.request import PoolingParams, RequestBatch
from pipepool.core.scheduler import BACKGROUND_SHARE, Scheduler

PARAMS = PoolingParams(pooling="mean")


def prompt_of(request_id: int, prompt_len: int) -> np.ndarray:
    return (np.arange(prompt_len, dtype=np.int64) + 7 * request_id) % 97


def make_batch(first_id: int, lens: list[int], *, background: bool = False) -> RequestBatch:
    prompts = [prompt_of(first_id + i, n) for i, n in enumerate(lens)]
    batch = RequestBatch.from_prompts(first_id, prompts, PARAMS)
    batch.background = background
    return batch


def make_scheduler(
    budget: int, max_seqs: int, *, chunked: bool = True, num_blocks: int = 1024, block_size=4
) -> Scheduler:
    blocks = BlockAllocator(num_blocks, block_size) if chunked else None
    return Scheduler(
        max_num_batched_tokens=budget, max_num_seqs=max_seqs, chunked=chunked, blocks=blocks
    )


def answer(plan: StepPlan, prompt_lens: dict[int, int]) -> StepResult:
    """What a correct last stage returns: every request advanced to its chunk end, and an
    output (its own id) for every request whose final chunk the plan holds."""
    done = [
        rid
        for rid, end in zip(plan.req_ids.tolist(), plan.ends.tolist(), strict=True)
        if end == prompt_lens[rid]
    ]
    return StepResult(
        step_id=plan.step_id,
        digest=expected_digest(plan.step_id, plan.expected_state, 1),
        vector_ids=np.array(done, dtype=np.int64),
        vectors=np.array(done, dtype=np.float32).reshape(-1, 1),
    )


class Tracker:
    """Checks every plan as it is produced and records how each prompt was cut."""

    def __init__(
        self, scheduler: Scheduler, prompt_lens: dict[int, int], *, encoder: bool = False
    ) -> None:
        self.scheduler = scheduler
        self.encoder = encoder  # whole prompts; one over the budget runs alone
        self.prompt_lens = prompt_lens
        self.arrival: list[int] = []  # request ids in the order they were added
        self.batches: dict[int, RequestBatch] = {}  # request id -> its batch
        self.chunks: dict[int, list[tuple[int, int]]] = {}
        self.finished: dict[int, float] = {}
        self.aborted: set[int] = set()
        self.plans = 0
        self.owed = 0.0  # tokens background work is owed (the scheduler's background_owed)
        self._next_id = 0

    def add(
        self, *lens: int, background: bool = False, slice_of: RequestBatch | None = None
    ) -> RequestBatch:
        """One batch of prompts with these lengths (consecutive ids); ``slice_of``: a later
        slice of that batch's call."""
        batch = make_batch(self._next_id, list(lens), background=background)
        if slice_of is not None:
            batch.call = slice_of.call
        for i, n in enumerate(lens):
            rid = self._next_id + i
            self.prompt_lens[rid] = n
            self.arrival.append(rid)
            self.batches[rid] = batch
        self._next_id += len(lens)
        self.scheduler.add(batch)
        return batch

    def abort(self, batch: RequestBatch) -> int:
        unplanned = self.scheduler.abort(batch)
        self.aborted.update(set(range(batch.first_id, batch.end_id)) - set(self.finished))
        return unplanned

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
        new_ids = plan.new.request_ids.tolist()
        # Background work's share: owed tokens, it goes first for them, online work filling
        # the rest (the scheduler's rule, kept here alongside).
        share = self._background_waiting() and int(self.owed) > 0
        expected_tokens = []
        for rid, start, end in zip(
            plan.req_ids.tolist(), plan.starts.tolist(), plan.ends.tolist(), strict=True
        ):
            assert rid not in self.aborted, f"aborted request {rid} scheduled again"
            previous = self.chunks.setdefault(rid, [])
            expected_start = previous[-1][1] if previous else 0
            assert start == expected_start, f"request {rid}: chunk starts at {start}"
            assert start < end <= self.prompt_lens[rid]
            assert (rid in new_ids) == (start == 0), "a request is new exactly once"
            expected_tokens.append(prompt_of(rid, self.prompt_lens[rid])[start:end])
            if self.encoder:
                assert (start, end) == (0, self.prompt_lens[rid]), "encoders never chunk"
            if start == 0:
                self._check_admission_order(rid, set(new_ids), share)
                i = new_ids.index(rid)
                assert plan.new.prompt_lens[i] == self.prompt_lens[rid]
                if s.blocks is not None:
                    # KV blocks for the whole prompt, only when it is split across steps.
                    chunked = end < self.prompt_lens[rid]
                    wanted = s.blocks.blocks_for(self.prompt_lens[rid]) if chunked else 0
                    assert len(plan.new.blocks(i)) == wanted
            previous.append((start, end))
        if plan.num_reqs:
            assert np.array_equal(plan.token_ids, np.concatenate(expected_tokens))
        kinds = {self.batches[rid].background for rid in new_ids}
        if not share:
            assert len(kinds) < 2, "a step that starts online requests starts no background ones"
        background = sum(
            end - start
            for rid, start, end in zip(plan.req_ids.tolist(), plan.starts.tolist(),
                                       plan.ends.tolist(), strict=True)
            if self.batches[rid].background
        )  # fmt: skip
        started = [
            (self.batches[rid].background, end)
            for rid, start, end in zip(plan.req_ids.tolist(), plan.starts.tolist(),
                                       plan.ends.tolist(), strict=True)
            if start == 0
        ]  # fmt: skip
        if share and not oversized_alone and any(not kind for kind, _ in started):
            # Beside online work it starts, background work takes what it is owed, no more.
            taken = sum(end for kind, end in started if kind)
            assert taken <= int(self.owed), "background work took more than it was owed"
        if not background and not self._background_waiting():
            self.owed = 0.0
        else:
            owed = self.owed + BACKGROUND_SHARE * plan.num_tokens - background
            self.owed = min(max(owed, -s.max_num_batched_tokens), s.max_num_batched_tokens)

    def _background_waiting(self) -> bool:
        """Whether a background request has not started (nor been aborted)."""
        return any(
            self.batches[r].background and r not in self.chunks and r not in self.aborted
            for r in self.arrival
        )

    def _check_admission_order(self, rid: int, new_ids: set[int], share: bool) -> None:
        """Fair admission: the earlier requests of ``rid``'s batch started already, and so
        did some request of every call that arrived before its call in its queue, unless
        ``rid``'s batch goes in whole in this plan (a small call); an online request overtakes
        any background one, except in background work's share of the steps (``share``).
        (Aborted requests excepted.)"""
        batch = self.batches[rid]

        def started(r: int) -> bool:
            return r in self.chunks or r in self.aborted

        behind = [r for r in range(batch.first_id, rid) if not started(r)]
        assert not behind, f"request {rid} started before {behind} of its own batch"
        whole = all(r in new_ids or started(r) for r in range(rid, batch.end_id))
        calls: dict[int, list[int]] = {}  # call -> its requests, calls in arrival order
        for r in self.arrival:
            calls.setdefault(self.batches[r].call, []).append(r)
        for call, requests in calls.items():
            other = self.batches[requests[0]]
            if call >= batch.call:
                break  # arrived with or after it (ids are given in arrival order)
            if other.background == batch.background:  # the same queue: calls start in order
                assert whole or any(started(r) for r in requests), (
                    f"request {rid} started before call {call}, which arrived earlier"
                )
            elif batch.background and not share:  # online work all goes first
                waiting = [r for r in requests if not started(r)]
                assert not waiting, f"background request {rid} overtook online {waiting}"

    def collect(self, plan: StepPlan) -> None:
        result = answer(plan, self.prompt_lens)
        ledger = self.scheduler.update(plan, result, last_stage=0)
        by_id = {b.first_id: b for b in ledger.batches}
        for rid, value in zip(result.vector_ids.tolist(), result.vectors[:, 0], strict=True):
            assert rid not in self.finished
            assert self.batches[rid].first_id in by_id, "a finished request's batch is listed"
            if self.batches[rid].cancelled:
                continue  # the engine drops results of cancelled batches
            self.finished[rid] = float(value)

    def assert_tiled(self, rid: int) -> None:
        """The chunks of a finished request cover [0, prompt_len) in order, no gap/overlap."""
        chunks = self.chunks[rid]
        assert chunks[0][0] == 0 and chunks[-1][1] == self.prompt_lens[rid]
        for (_, end), (start, _) in itertools.pairwise(chunks):
            assert start == end

    def assert_drained(self) -> None:
        s = self.scheduler
        assert s.num_waiting == 0 and s.num_admitted == 0
        assert not s.waiting and not s.running and not s.has_schedulable()
        if s.blocks is not None:
            assert s.blocks.num_free == s.blocks.num_blocks, "KV blocks leaked"


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
        t = Tracker(s, {})
        for _ in range(int(rng.integers(1, 5))):  # batches of 1-4 prompts
            t.add(*rng.integers(1, 120, size=int(rng.integers(1, 5))).tolist())
        run(t, depth=int(rng.integers(1, 5)))
        assert sorted(t.finished) == sorted(t.prompt_lens), f"trial {trial}"
        for rid in t.prompt_lens:
            t.assert_tiled(rid)
            assert t.finished[rid] == rid  # each output went to its own request
        t.assert_drained()


def test_requests_arriving_between_steps_keep_fifo_and_budget():
    rng = np.random.default_rng(7)
    for budget in (1, 7, 33):
        s = make_scheduler(budget, 4, num_blocks=60)
        t = Tracker(s, {})
        inflight: deque[StepPlan] = deque()
        for _ in range(300):
            for _ in range(int(rng.integers(0, 3))):
                t.add(*rng.integers(1, 90, size=int(rng.integers(1, 3))).tolist())
            plan = s.schedule()
            if plan is not None:
                t.check(plan)
                inflight.append(plan)
            if inflight and (len(inflight) >= 3 or rng.random() < 0.5):
                t.collect(inflight.popleft())
        run(t, depth=3, inflight=inflight)
        assert sorted(t.finished) == list(range(len(t.prompt_lens)))
        for rid in t.prompt_lens:
            t.assert_tiled(rid)
        t.assert_drained()


def test_long_prompt_is_split_into_budget_sized_chunks():
    s = make_scheduler(16, 8)
    t = Tracker(s, {})
    t.add(50)
    run(t)
    assert t.chunks[0] == [(0, 16), (16, 32), (32, 48), (48, 50)]


def test_prompt_that_fits_a_step_is_not_split_once_the_step_is_half_full():
    """Short prompts never pay for the KV cache: the one that does not fit what is left of a
    step at least half full waits for the next step; in an emptier step it is split."""
    s = make_scheduler(16, 64)
    t = Tracker(s, {})
    t.add(10, 12, 3, 14, 20)
    run(t)
    assert t.chunks[1] == [(0, 12)], "12 tokens after 10 of 16: waits for the next step"
    assert t.chunks[2] == [(0, 3)]  # ... behind it (FIFO), in the same step
    assert t.chunks[3] == [(0, 14)], "15 of 16 taken: waits too"
    assert t.chunks[4] == [(0, 2), (2, 18), (18, 20)], "longer than a step: always split"
    t.assert_drained()
    s = make_scheduler(16, 64)
    t = Tracker(s, {})
    t.add(4, 14)
    run(t)
    assert t.chunks[1] == [(0, 12), (12, 14)], "4 of 16 taken: split, the step is filled"
    t.assert_drained()


def test_many_short_prompts_fill_steps_to_the_token_budget():
    """No request cap below the budget: a step of short prompts is bounded by tokens."""
    s = make_scheduler(1024, 1024, chunked=False)
    t = Tracker(s, {}, encoder=True)
    t.add(*[8] * 1000)
    plan = s.schedule()
    t.check(plan)
    assert plan.num_reqs == 128 and plan.num_tokens == 1024
    t.collect(plan)
    run(t)
    assert len(t.finished) == 1000
    t.assert_drained()


def test_next_chunk_is_planned_while_previous_chunk_is_in_flight():
    s = make_scheduler(8, 8)
    t = Tracker(s, {})
    t.add(20)
    plans = [s.schedule() for _ in range(3)]
    assert [(int(p.starts[0]), int(p.ends[0])) for p in plans] == [(0, 8), (8, 16), (16, 20)]
    assert s.schedule() is None
    for plan in plans:
        t.check(plan)
        t.collect(plan)
    assert t.finished == {0: 0.0}
    t.assert_drained()


def test_aborts_of_waiting_running_and_scheduled_requests_return_every_block():
    s = make_scheduler(8, 2, num_blocks=16, block_size=4)
    t = Tracker(s, {})
    batches = [t.add(n) for n in (30, 12, 10, 5, 9)]  # one batch per request
    first = s.schedule()  # request 0: tokens [0, 8), split: it holds blocks
    t.check(first)
    assert first.req_ids.tolist() == [0]
    assert s.blocks.num_free == 16 - 8  # the whole prompt's blocks, at admission

    # Abort a waiting request: it never appears in a plan and never held blocks.
    assert t.abort(batches[3]) == 5, "all of its tokens go unplanned"
    assert s.blocks.num_free == 8 and s.num_waiting == 3

    # Abort the split request while its first chunk is still in flight.
    assert t.abort(batches[0]) == 30 - 8
    assert s.blocks.num_free == 16, "a split request's blocks return at abort"

    second = s.schedule()
    t.check(second)
    assert second.freed_ids == (0,), "the stages are told to drop the aborted request"
    assert second.req_ids.tolist() == [1]  # 12 tokens: [0, 8)
    third = s.schedule()
    t.check(third)
    assert third.req_ids.tolist() == [1, 2]  # request 1 ends, request 2 starts

    # Abort a fully scheduled request: its blocks came back when its final chunk was planned.
    free_before = s.blocks.num_free
    assert t.abort(batches[1]) == 0
    assert s.blocks.num_free == free_before
    t.abort(batches[1])  # aborting twice is a no-op
    assert s.blocks.num_free == free_before

    # Results of the aborted requests' chunks still come back; they are dropped.
    for plan in (first, second, third):
        t.collect(plan)
    assert 0 not in t.finished and 1 not in t.finished
    run(t, depth=2)
    assert sorted(t.finished) == [2, 4]
    t.assert_drained()


def test_aborting_a_batch_drops_the_rest_of_it_and_keeps_fifo():
    s = make_scheduler(10, 4)
    t = Tracker(s, {})
    first = t.add(4, 4, 4, 4, 4)
    t.add(3, 3)
    plan = s.schedule()  # 4 + 4 of the first batch, 2 of the third prompt (split)
    t.check(plan)
    assert plan.req_ids.tolist() == [0, 1]
    t.abort(first)
    assert s.num_waiting == 2
    t.collect(plan)
    run(t)
    assert sorted(t.finished) == [5, 6]
    t.assert_drained()


def test_random_aborts_never_leak_blocks():
    rng = np.random.default_rng(3)
    for trial in range(40):
        budget = int(rng.choice([1, 7, 16, 40]))
        s = make_scheduler(budget, int(rng.integers(1, 6)), num_blocks=50, block_size=4)
        t = Tracker(s, {})
        batches = [t.add(*rng.integers(1, 100, size=int(rng.integers(1, 4))).tolist())
                   for _ in range(5)]  # fmt: skip
        inflight: deque[StepPlan] = deque()
        while s.has_schedulable() or inflight:
            if rng.random() < 0.15:
                t.abort(batches[int(rng.integers(0, len(batches)))])
            plan = s.schedule() if len(inflight) < 3 else None
            if plan is not None:
                t.check(plan)
                inflight.append(plan)
            elif inflight:
                t.collect(inflight.popleft())
        assert set(t.finished) | t.aborted == set(t.prompt_lens), f"trial {trial}"
        assert not set(t.finished) & t.aborted
        t.assert_drained()


def test_request_waits_for_blocks_and_proceeds_when_they_return():
    s = make_scheduler(10, 8, num_blocks=4, block_size=4)  # 16 tokens of KV in all
    t = Tracker(s, {})
    t.add(12, 12, 3)
    plans = []
    for expected in ([0], [0], [1], [1, 2]):
        plan = s.schedule()
        t.check(plan)
        assert plan.req_ids.tolist() == expected
        plans.append(plan)
        if len(plans) == 2:
            # Request 1 (longer than a step) needs 3 blocks, request 0 holds 3 of 4 until
            # this plan is built: request 1 waits, and request 2 (whole, no blocks) may not
            # overtake it.
            assert s.waiting[0].cursor == 1 and s.num_waiting == 2
    for plan in plans:
        t.collect(plan)
    assert sorted(t.finished) == [0, 1, 2]
    t.assert_drained()


def test_blocks_held_by_a_partly_scheduled_prompt_make_the_queue_wait():
    s = make_scheduler(6, 8, num_blocks=4, block_size=4)
    t = Tracker(s, {})
    t.add(16)  # chunks 6, 6, 4: holds all 4 blocks until its final chunk
    t.add(8)  # would start with 2 tokens in plan 3, but has no blocks yet
    plans = []
    for expected in ([0], [0], [0], [1], [1]):
        plan = s.schedule()
        t.check(plan)
        assert plan.req_ids.tolist() == expected
        plans.append(plan)
    for plan in plans:
        t.collect(plan)
    t.assert_drained()


@pytest.mark.parametrize("budget", [1, 7, 16])
def test_encoder_mode_schedules_whole_prompts_and_oversized_ones_alone(budget):
    rng = np.random.default_rng(budget)
    for trial in range(30):
        s = make_scheduler(budget, int(rng.integers(1, 8)), chunked=False)
        t = Tracker(s, {}, encoder=True)
        for _ in range(4):
            t.add(*rng.integers(1, 40, size=3).tolist())
        run(t, depth=int(rng.integers(1, 4)))
        assert sorted(t.finished) == sorted(t.prompt_lens), f"trial {trial}"
        for rid, n in t.prompt_lens.items():
            assert t.chunks[rid] == [(0, n)], "encoders never chunk"
        assert any(n > budget for n in t.prompt_lens.values())
        t.assert_drained()


def test_encoder_prompt_over_budget_waits_for_an_empty_step():
    s = make_scheduler(10, 8, chunked=False)
    t = Tracker(s, {}, encoder=True)
    t.add(4, 25, 3)
    plans = [s.schedule() for _ in range(3)]
    assert [p.req_ids.tolist() for p in plans] == [[0], [1], [2]]
    assert [p.num_tokens for p in plans] == [4, 25, 3]
    assert s.schedule() is None
    for plan in plans:
        t.check(plan)
        t.collect(plan)
    assert sorted(t.finished) == [0, 1, 2]


def test_update_rejects_a_result_that_disagrees_with_the_plan():
    s = make_scheduler(8, 8)
    t = Tracker(s, {})
    t.add(20, 3)
    plan = s.schedule()
    t.check(plan)
    assert plan.req_ids.tolist() == [0] and plan.ends.tolist() == [8]
    right = expected_digest(plan.step_id, plan.expected_state, 2)
    # The historical bug: stage 0 never advanced; its own hashes and the chain differ.
    bumped = right.parts + np.eye(2, 4, dtype=np.int64)
    stale = Digest(plan.step_id, right.chain + np.array([1, 0]), bumped)
    with pytest.raises(pipepool.StateDivergence, match=r"step 0, stage 0: num_computed") as info:
        s.update(plan, StepResult(step_id=plan.step_id, digest=stale), last_stage=1)
    assert info.value.check == "driver" and info.value.stage == 0
    # Stage 1's own state is right but it folded a chain other than stage 0's.
    refolded = Digest(plan.step_id, right.chain + np.array([0, 1]), right.parts)
    with pytest.raises(pipepool.StateDivergence, match=r"stage 1: digest chain"):
        s.update(plan, StepResult(step_id=plan.step_id, digest=refolded), last_stage=1)
    short = Digest(plan.step_id, right.chain[:1], right.parts[:1])
    with pytest.raises(pipepool.StateDivergence, match="stages in the digest chain"):
        s.update(plan, StepResult(step_id=plan.step_id, digest=short), last_stage=1)
    wrong_step = StepResult(step_id=plan.step_id + 5, digest=right)
    with pytest.raises(pipepool.StateDivergence, match="step id expected 0, found 5"):
        s.update(plan, wrong_step, last_stage=1)
    # An output for a request the plan did not finish (request 0 has 12 tokens to go).
    extra = StepResult(
        step_id=plan.step_id, digest=right, vector_ids=np.array([0]),
        vectors=np.zeros((1, 1), np.float32),
    )  # fmt: skip
    with pytest.raises(pipepool.StageFailure, match="outputs for 1 requests, the plan finished 0"):
        s.update(plan, extra, last_stage=1)
    t.collect(plan)
    run(t)
    assert sorted(t.finished) == [0, 1]
    t.assert_drained()


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
        submissions = [engine.submit([prompts[i]]) for i in order]
        vectors = np.concatenate([f.result() for f in submissions])
        by_prompt = np.empty_like(vectors)
        by_prompt[order] = vectors
        assert cosine(by_prompt, reference).min() >= 0.99999
    assert engine.stats.chunked_requests > chunked_before, "the budget never forced chunking"


def test_a_smaller_budget_for_one_step_keeps_every_rule_within_it():
    """``schedule(max_tokens)`` (the step that starts an idle pipeline): whole prompts up to the
    smaller budget, an encoder prompt over it (but within the budget) alone rather than never,
    a causal prompt chunked at it; the next step has the whole budget again."""
    s = make_scheduler(16, 64, chunked=False)
    t = Tracker(s, {}, encoder=True)
    t.add(3, 4, 10, 12, 2)
    small = s.schedule(max_tokens=8)
    t.check(small)
    assert small.req_ids.tolist() == [0, 1], "3 + 4 of 8; the 10 would overflow it"
    alone = s.schedule(max_tokens=8)
    t.check(alone)
    assert alone.req_ids.tolist() == [2], "over the smaller budget: alone, not stuck"
    whole = s.schedule()
    t.check(whole)
    assert whole.req_ids.tolist() == [3, 4] and whole.num_tokens == 14
    for plan in (small, alone, whole):
        t.collect(plan)
    assert len(t.finished) == 5
    t.assert_drained()

    s = make_scheduler(16, 64)
    t = Tracker(s, {})
    t.add(20)
    plans = [s.schedule(max_tokens=6), s.schedule(), s.schedule()]
    assert [(int(p.starts[0]), int(p.ends[0])) for p in plans[:2]] == [(0, 6), (6, 20)]
    assert plans[2] is None
    for plan in plans[:2]:
        t.check(plan)
        t.collect(plan)
    assert t.finished == {0: 0.0}
    t.assert_drained()


@pytest.mark.parametrize("chunked", [True, False])
def test_a_small_batch_starts_in_the_next_step_not_after_a_large_one(chunked):
    s = make_scheduler(16, 64, chunked=chunked)
    t = Tracker(s, {}, encoder=not chunked)
    large = t.add(*[4] * 40)  # ten full steps
    first = s.schedule()
    t.check(first)
    small = t.add(3)
    second = s.schedule()
    t.check(second)
    assert second.new.request_ids[0] == small.first_id  # first in the very next step
    assert second.num_tokens == 15  # the large batch fills what is left (3 + 3 × 4)
    third = s.schedule()
    t.check(third)
    assert set(third.req_ids.tolist()) <= set(range(large.first_id, large.end_id))
    for plan in (first, second, third):
        t.collect(plan)
    run(t)
    assert sorted(t.finished) == list(range(41))
    t.assert_drained()


def test_large_batches_take_turns_step_by_step():
    s = make_scheduler(8, 64, chunked=False)
    t = Tracker(s, {}, encoder=True)
    a, b = t.add(*[4] * 10), t.add(*[4] * 10)
    owners = []
    for _ in range(6):
        plan = s.schedule()
        t.check(plan)
        owners.append({"a" if rid < b.first_id else "b" for rid in plan.req_ids.tolist()})
        t.collect(plan)
    assert owners == [{"a"}, {"b"}, {"a"}, {"b"}, {"a"}, {"b"}]
    assert a.cursor == b.cursor == 6
    run(t)
    t.assert_drained()


@pytest.mark.parametrize("chunked", [True, False])
def test_background_work_takes_only_steps_without_online_work(chunked):
    s = make_scheduler(16, 64, chunked=chunked)
    t = Tracker(s, {}, encoder=not chunked)
    job = t.add(*[4] * 20, background=True)
    first = s.schedule()
    t.check(first)
    assert first.num_tokens == 16  # alone, background work takes whole steps
    online = t.add(4, 4, 4)
    second = s.schedule()
    t.check(second)
    # Online alone, as short as it is: the job waits for the next step.
    assert second.new.request_ids.tolist() == list(range(online.first_id, online.end_id))
    third = s.schedule()
    t.check(third)
    assert third.new.request_ids.tolist() == list(range(job.first_id + 4, job.first_id + 8))
    for plan in (first, second, third):
        t.collect(plan)
    run(t)
    assert sorted(t.finished) == list(range(23))
    t.assert_drained()


@pytest.mark.parametrize("chunked", [True, False])
def test_background_work_gets_a_tenth_of_the_tokens_however_busy_online_work_keeps_them(chunked):
    """Online calls that always wait (a new one each step) would starve a batch job: it is
    owed ``BACKGROUND_SHARE`` of the tokens planned, and goes first for what it is owed, in
    small parts (online work fills each step)."""
    s = make_scheduler(16, 64, chunked=chunked)
    t = Tracker(s, {}, encoder=not chunked)
    job = t.add(*[4] * 40, background=True)
    t.add(4, 4, 4, 4)
    total = background = 0
    for _ in range(100):
        t.add(4, 4, 4, 4)  # online work is always waiting
        plan = s.schedule()
        t.check(plan)
        t.collect(plan)
        assert plan.num_tokens == 16
        total += plan.num_tokens
        background += sum(4 for r in plan.req_ids.tolist() if job.first_id <= r < job.end_id)
        # Owed at most a prompt and one step's share; ahead by less than a prompt.
        assert abs(background - BACKGROUND_SHARE * total) <= 4 + BACKGROUND_SHARE * 16
    assert background >= 150
    run(t)
    t.assert_drained()


@pytest.mark.parametrize("chunked", [True, False])
def test_random_mixes_of_online_and_background_batches_keep_every_invariant(chunked):
    rng = np.random.default_rng(11 if chunked else 12)
    for trial in range(20):
        budget = int(rng.choice([7, 16, 64]))
        s = make_scheduler(budget, int(rng.choice([3, 256])), chunked=chunked, num_blocks=80)
        t = Tracker(s, {}, encoder=not chunked)
        inflight: deque[StepPlan] = deque()
        added: list[RequestBatch] = []
        for _ in range(60):
            for _ in range(int(rng.integers(0, 3))):
                lens = rng.integers(1, 40, size=int(rng.integers(1, 6))).tolist()
                if added and rng.random() < 0.3:  # a later slice of an earlier call
                    call = added[int(rng.integers(len(added)))]
                    added.append(t.add(*lens, background=call.background, slice_of=call))
                else:
                    added.append(t.add(*lens, background=bool(rng.random() < 0.4)))
            plan = s.schedule()
            if plan is not None:
                t.check(plan)
                inflight.append(plan)
            if inflight and (len(inflight) >= 3 or rng.random() < 0.5):
                t.collect(inflight.popleft())
        run(t, depth=3, inflight=inflight)
        assert sorted(t.finished) == list(range(len(t.prompt_lens))), f"trial {trial}"
        for rid in t.prompt_lens:
            t.assert_tiled(rid)
        t.assert_drained()


@pytest.mark.parametrize("chunked", [True, False])
def test_small_calls_behind_many_large_ones_start_in_the_next_step(chunked):
    s = make_scheduler(32, 64, chunked=chunked)
    t = Tracker(s, {}, encoder=not chunked)
    for _ in range(8):
        t.add(*[4] * 30)  # eight large calls: 60 steps of work
    first = s.schedule()
    t.check(first)
    small = [t.add(2), t.add(1, 2)]
    second = s.schedule()
    t.check(second)
    new = second.new.request_ids.tolist()
    assert {b.first_id for b in small} | {small[1].first_id + 1} <= set(new)
    t.collect(first)
    t.collect(second)
    run(t)
    assert len(t.finished) == 8 * 30 + 3
    t.assert_drained()


@pytest.mark.parametrize("chunked", [True, False])
def test_small_calls_taken_from_between_large_ones_leave_the_rest_in_order(chunked):
    s = make_scheduler(32, 64, chunked=chunked)
    t = Tracker(s, {}, encoder=not chunked)
    a = t.add(*[4] * 30)
    first = s.schedule()  # a alone: a whole step of it
    t.check(first)
    s1, b, s2, c = t.add(2), t.add(*[4] * 30), t.add(1), t.add(*[4] * 30)
    second = s.schedule()
    t.check(second)
    new = second.new.request_ids.tolist()
    assert new[:2] == [s1.first_id, s2.first_id]  # the small calls, each whole, first
    assert new[2:] == list(range(b.first_id, b.first_id + 7))  # then b fills the step
    assert list(s.waiting) == [b, c, a]  # a had the last turn: behind the others
    for plan in (first, second):
        t.collect(plan)
    run(t)
    assert len(t.finished) == 3 * 30 + 2
    t.assert_drained()


@pytest.mark.parametrize("chunked", [True, False])
def test_more_calls_than_tokens_in_a_step_are_taken_in_order(chunked):
    s = make_scheduler(16, 64, chunked=chunked)
    t = Tracker(s, {}, encoder=not chunked)
    calls = [t.add(1) for _ in range(40)]  # the equal share of a step is under a token
    for k in range(3):
        plan = s.schedule()
        t.check(plan)
        assert plan.new.request_ids.tolist() == [c.first_id for c in calls[16 * k : 16 * k + 16]]
        t.collect(plan)
    t.assert_drained()


def test_a_call_in_several_slices_takes_turns_as_one_call():
    s = make_scheduler(8, 64, chunked=False)
    t = Tracker(s, {}, encoder=True)
    x = t.add(*[4] * 4)
    x_slices = [x, t.add(*[4] * 4, slice_of=x), t.add(*[4] * 4, slice_of=x)]
    y = t.add(*[4] * 12)
    owners = []
    for _ in range(6):
        plan = s.schedule()
        t.check(plan)
        owners.append({"y" if rid >= y.first_id else "x" for rid in plan.req_ids.tolist()})
        t.collect(plan)
    assert owners == [{"x"}, {"y"}, {"x"}, {"y"}, {"x"}, {"y"}]
    assert sum(b.cursor for b in x_slices) == y.cursor == 6
    run(t)
    t.assert_drained()
