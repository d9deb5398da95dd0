"""Issue 11: each lockstep check of docs/design.md §1 catches a fault alone, and stage-local faults
on a non-last stage are caught in the step they happen, naming the stage and what differs.

The pipeline is driven step by step (scheduler -> in-process stages -> scheduler.update), so
that an abort or a tampered plan lands exactly where the test wants it. Each check's test is
written so that it fails when that check alone is removed:

- mirror (a stage against the plan, before computing): a plan whose chunk positions disagree
  with the stages, while its expected digest agrees with them, is caught by nothing else;
- neighbour (a stage checking the digest it received): the error comes from the step's
  execution, before the last stage answers; without it, only the driver would see it later;
- driver (the scheduler checking the whole chain): a fault on the last stage, where no stage
  comes after.
"""

from __future__ import annotations

import dataclasses
import pickle

import faults
import numpy as np
import pytest

from pipepool import StateDivergence
from pipepool.config import EngineConfig
from pipepool.core.kv_blocks import BlockAllocator
from pipepool.core.plan import StepPlan
from pipepool.core.request import PoolingParams, RequestBatch
from pipepool.core.scheduler import Scheduler
from pipepool.loading.deployment import plan_deployment
from pipepool.parallel.launch import start_executor

BUDGET = 8  # tokens per step: a 40-token prompt takes five steps


class SteppedPipeline:
    """Scheduler and in-process stages, one step at a time."""

    def __init__(self, path, *, pp: int, fault=None, monkeypatch=None, **options) -> None:
        """``fault``: (kind, stage) of tests/faults.py, installed through ``monkeypatch``."""
        config = EngineConfig(
            model=str(path), pipeline_parallel_size=pp, pipeline_backend="inproc",
            max_num_batched_tokens=BUDGET, **options,
        )  # fmt: skip
        self.deployment = plan_deployment(config)
        if fault is not None:
            faults.install(monkeypatch, fault[0], stage=fault[1])
        self.executor = start_executor(self.deployment)
        d = self.deployment
        self.scheduler = Scheduler(
            max_num_batched_tokens=BUDGET, max_num_seqs=4, chunked=True,
            blocks=BlockAllocator(d.num_kv_blocks, config.block_size),
        )  # fmt: skip
        self.next_id = 0

    def add(self, lengths: list[int], pooling: str = "last") -> RequestBatch:
        prompts = [np.arange(3, 3 + n, dtype=np.int64) % 100 for n in lengths]
        batch = RequestBatch.from_prompts(self.next_id, prompts, PoolingParams(pooling=pooling))
        self.next_id += len(lengths)
        self.scheduler.add(batch)
        return batch

    def plan(self) -> StepPlan:
        plan = self.scheduler.schedule()
        assert plan is not None
        return plan

    def run(self, plan: StepPlan) -> None:
        """Every stage applies the plan (neighbour checks run here), then the driver checks."""
        self.executor.submit(plan)
        self.finish(plan)

    def finish(self, plan: StepPlan) -> None:
        result = self.executor.collect()
        self.scheduler.update(plan, result, last_stage=self.executor.num_stages - 1)


def test_mirror_check_refuses_a_plan_whose_chunks_disagree_with_the_stages(qwen3_path):
    """A plan (corrupted on its way, or by a scheduler bug) that puts request 0's next chunk
    one token further than the stages computed. Its expected digest is the scheduler's own,
    which the stages' arithmetic matches, so only the mirror check can see it, and it does
    before stage 0 computes anything."""
    pipe = SteppedPipeline(qwen3_path, pp=2)
    pipe.add([40])
    pipe.run(pipe.plan())
    plan = pipe.plan()
    assert plan.starts.tolist() == [BUDGET]
    shifted = dataclasses.replace(plan, starts=plan.starts + 1, ends=plan.ends + 1)
    with pytest.raises(StateDivergence) as info:
        pipe.run(shifted)
    err = info.value
    assert (err.check, err.stage, err.step_id, err.request_id) == ("mirror", 0, 1, 0)
    assert (err.expected, err.found) == (BUDGET + 1, BUDGET)
    assert "before computing" in str(err)


def test_neighbour_check_stops_the_step_before_the_last_stage_answers(qwen3_path, monkeypatch):
    """Stage 0 registers a wrong block table: stage 1 sees it in stage 0's digest during the
    step itself; the step never produces a result for the driver."""
    pipe = SteppedPipeline(
        qwen3_path, pp=2, fault=("wrong_block_table", 0), monkeypatch=monkeypatch
    )
    pipe.add([40])
    with pytest.raises(StateDivergence) as info:
        pipe.executor.submit(pipe.plan())  # stage 1's neighbour check fires in here
    err = info.value
    assert (err.check, err.found_by, err.stage, err.step_id) == ("neighbour", "stage 1", 0, 0)
    assert "block tables" in str(err)


def test_driver_check_catches_a_fault_on_the_last_stage(qwen3_path, monkeypatch):
    """The last stage keeps an aborted request's mirror: no stage comes after it, and the
    request is never scheduled again for a mirror check to see; only the driver can tell."""
    pipe = SteppedPipeline(
        qwen3_path, pp=2, fault=("keep_aborted_mirror", 1), monkeypatch=monkeypatch
    )
    batch = pipe.add([40])
    pipe.run(pipe.plan())
    pipe.scheduler.abort(batch)
    plan = pipe.plan()
    assert plan.freed_ids == (0,)
    pipe.executor.submit(plan)  # every stage applies it without complaint
    with pytest.raises(StateDivergence) as info:
        pipe.finish(plan)
    err = info.value
    assert (err.check, err.found_by, err.stage, err.step_id) == ("driver", "the driver", 1, 1)
    assert "set of live requests" in str(err)


@pytest.mark.parametrize(
    ("fault", "pooling", "abort", "part"),
    [
        ("wrong_block_table", "last", False, "block tables"),
        ("pool_on_non_last_stage", "mean", False, "pooler state"),
        ("keep_aborted_mirror", "last", True, "set of live requests"),
        ("drop_request", "last", False, "set of live requests"),
    ],
)
def test_stage_local_fault_on_a_middle_stage_is_named(
    qwen3_path, fault, pooling, abort, part, monkeypatch
):
    """PP=3, the fault on stage 1: caught in the step it happens, by stage 2, naming stage 1
    (the chain carries stage 0's state through it) and the part of the state that differs."""
    pipe = SteppedPipeline(qwen3_path, pp=3, fault=(fault, 1), monkeypatch=monkeypatch)
    batch = pipe.add([40, 5], pooling=pooling)
    step = 0
    if abort:
        pipe.run(pipe.plan())
        pipe.scheduler.abort(batch)
        step = 1
    with pytest.raises(StateDivergence) as info:
        pipe.run(pipe.plan())
    err = info.value
    assert (err.check, err.found_by, err.stage, err.step_id) == ("neighbour", "stage 2", 1, step)
    assert part in str(err)


def test_no_fault_no_divergence_through_aborts_and_every_pooler(qwen3_path):
    """The expectation is exact: a clean PP=3 pipeline runs splits, aborts and accumulating
    poolers to the end without a single check firing."""
    pipe = SteppedPipeline(qwen3_path, pp=3)
    for pooling in ("last", "mean", "cls", "all"):
        pipe.add([40, 3, 17], pooling=pooling)
    doomed = pipe.add([33], pooling="mean")
    steps = 0
    while pipe.scheduler.has_schedulable():
        pipe.run(pipe.plan())
        steps += 1
        if steps == 3:
            pipe.scheduler.abort(doomed)
    assert steps > 10
    assert pipe.scheduler.blocks.num_free == pipe.scheduler.blocks.num_blocks


def test_a_rank_refuses_a_deployment_plan_whose_digest_differs(qwen3_path):
    """The hand-off of the one deployment plan: a rank recomputes the plan's digest from what
    it unpickled and refuses to load weights when it differs from the driver's."""
    import torch.distributed as dist

    from pipepool import ModelLoadError
    from pipepool.parallel import handoff

    deployment = plan_deployment(EngineConfig(model=str(qwen3_path), pipeline_parallel_size=2))
    store = dist.HashStore()
    handoff.publish(store, deployment)
    assert handoff.receive(store, 1) == deployment
    assert store.get("fingerprint/1").decode() == deployment.fingerprint()
    other = dataclasses.replace(deployment, num_kv_blocks=deployment.num_kv_blocks - 1)
    store.set(handoff.PLAN_KEY, pickle.dumps(other))  # what rank 1 gets is not the driver's
    with pytest.raises(ModelLoadError, match="rank 1 received a deployment plan whose digest"):
        handoff.receive(store, 1)


def test_ranks_waiting_for_a_plan_hear_at_once_that_the_driver_could_not_make_one():
    import torch.distributed as dist

    from pipepool import StageFailure
    from pipepool.parallel import handoff

    store = dist.HashStore()
    store.set(handoff.PLAN_ERROR_KEY, b"StageFailure: torchrun started 2 ranks for pp=3")
    with pytest.raises(StageFailure, match=r"could not plan the deployment: .*2 ranks for pp=3"):
        handoff.receive(store, 1)
