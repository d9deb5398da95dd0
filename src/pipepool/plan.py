"""The step contract between the scheduler and the stages (DESIGN.md §2).

``Scheduler.schedule() -> StepPlan``; every stage applies the same plan in the same order;
the last stage answers with a ``StepResult``; ``Scheduler.update(plan, result)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import StateDivergence


@dataclass(frozen=True)
class NewRequest:
    """Sent once, in the first plan that schedules the request."""

    request_id: int
    prompt_len: int
    pooling: str  # last | mean | cls | all
    block_ids: np.ndarray  # [ceil(prompt_len / block_size)] int32 KV blocks (empty for encoders)


@dataclass(frozen=True)
class StepPlan:
    """Everything a stage needs for one step. Small and picklable.

    Invariants: ``starts[i] < ends[i]``; ``num_tokens == sum(ends - starts)``; request ids are
    unique; ``starts[i]`` is the scheduler's expected ``num_computed_tokens`` of request i at
    step start, which each stage checks against its own mirror before computing.
    """

    step_id: int
    req_ids: np.ndarray  # [R] int64, batch order (the packed batch follows this order)
    starts: np.ndarray  # [R] int64 chunk start
    ends: np.ndarray  # [R] int64 chunk end, exclusive
    new_requests: tuple[NewRequest, ...] = ()
    # Prompt tokens of new requests. Only the first stage embeds tokens, so the executor
    # strips this before sending a plan to other stages.
    new_token_ids: dict[int, np.ndarray] = field(default_factory=dict)
    # Requests aborted before their final chunk: stages drop their mirrors after this step.
    freed_ids: tuple[int, ...] = ()
    num_tokens: int = 0  # == sum(ends - starts)

    def __post_init__(self) -> None:
        assert len(self.req_ids) == len(self.starts) == len(self.ends)
        assert self.num_tokens == int((self.ends - self.starts).sum())
        assert bool((self.starts < self.ends).all()), "empty chunk in plan"
        assert len(np.unique(self.req_ids)) == len(self.req_ids), "request scheduled twice"

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def is_shutdown(self) -> bool:
        return self.step_id == _SHUTDOWN

    @property
    def is_flush(self) -> bool:
        return self.step_id == _FLUSH


# Control plans: step ids below 0 carry no work.
_SHUTDOWN, _FLUSH = -1, -2


def shutdown_plan() -> StepPlan:
    """The plan that tells a stage process to exit its loop."""
    return _control_plan(_SHUTDOWN)


def flush_plan() -> StepPlan:
    """The plan that tells a last stage holding a step's results back to send them now
    (the driver is about to wait for them and has no further plan to send)."""
    return _control_plan(_FLUSH)


def _control_plan(step_id: int) -> StepPlan:
    empty = np.empty(0, dtype=np.int64)
    return StepPlan(step_id=step_id, req_ids=empty, starts=empty, ends=empty)


@dataclass(frozen=True)
class StepResult:
    """The last stage's answer to one plan."""

    step_id: int
    # [R] num_computed_tokens of each scheduled request after the last stage's post-step,
    # in plan order; the driver checks it equals plan.ends.
    digest: np.ndarray
    # Finished requests: pooled vector [D] (float32), or token embeddings [len, H] for "all".
    outputs: dict[int, np.ndarray]
    # Seconds each stage spent computing this step (stage order), for idle-fraction metrics.
    stage_busy_s: tuple[float, ...] = ()


def check_digest(plan: StepPlan, digest: np.ndarray, *, stage: int) -> None:
    """A stage's post-step digest must say that every scheduled request advanced exactly to
    its chunk end; otherwise StateDivergence names the first request that did not."""
    if digest.shape == plan.ends.shape and np.array_equal(digest, plan.ends):
        return
    n = min(len(digest), len(plan.ends))
    diff = np.nonzero(digest[:n] != plan.ends[:n])[0]
    i = int(diff[0]) if len(diff) else n
    raise StateDivergence(
        step_id=plan.step_id,
        stage=stage,
        request_id=int(plan.req_ids[i]) if i < plan.num_reqs else -1,
        expected=int(plan.ends[i]) if i < len(plan.ends) else -1,
        found=int(digest[i]) if i < len(digest) else -1,
    )
