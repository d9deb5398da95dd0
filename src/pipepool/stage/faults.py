"""Test-only faults a stage can be told to commit (``EngineConfig.inject_fault``), each a
stage-local slip that the lockstep checks of DESIGN.md §1 must catch. Off by default: a stage
without a fault holds ``None`` and pays one ``is None`` per hook."""

from __future__ import annotations

import numpy as np

from ..config import EngineConfig
from ..core.plan import StepPlan
from .mirror import Mirror, StepView


class StageFaults:
    """The fault ``config.inject_fault`` on the stage it targets (``fault_stage``)."""

    def __init__(self, kind: str, stage: int, step: int) -> None:
        self.kind, self.stage, self.step = kind, stage, step

    @classmethod
    def of(cls, config: EngineConfig, index: int, is_last: bool) -> StageFaults | None:
        kind = config.inject_fault
        if kind is None:
            return None
        if kind == "skip_post_step_on_non_last_stage":  # the historical bug: every such stage
            return None if is_last else cls(kind, index, 0)
        return cls(kind, index, config.fault_step) if index == config.fault_stage else None

    @property
    def skips_post_step(self) -> bool:
        return self.kind == "skip_post_step_on_non_last_stage"

    @property
    def pools(self) -> bool:
        """A stage that is not the last keeps pooling state anyway."""
        return self.kind == "pool_on_non_last_stage"

    @property
    def keeps_freed(self) -> bool:
        """Aborted requests' mirrors are left behind."""
        return self.kind == "keep_aborted_mirror"

    def maybe_raise(self, plan: StepPlan) -> None:
        if self.kind == "raise_on_stage" and plan.step_id >= self.step:
            raise RuntimeError(f"injected failure on stage {self.stage} at step {plan.step_id}")

    def after_register(self, view: StepView, num_new_entries: int) -> None:
        """``wrong_block_table``: the tables of requests registered this step are off by one
        block."""
        if self.kind == "wrong_block_table" and num_new_entries:
            for entry in view.entries[-num_new_entries:]:
                entry.block_ids = np.asarray(entry.block_ids) + 1

    def after_post_step(self, mirror: Mirror, plan: StepPlan) -> None:
        """``drop_request``: a request whose prompt has chunks to go is forgotten."""
        if self.kind == "drop_request" and plan.step_id >= self.step and mirror.entries:
            mirror.entries.pop(min(mirror.entries))
