"""Test-only faults a stage can be made to commit, each a stage-local slip that the lockstep
checks of docs/design.md §1 must catch. Never shipped, and the product has no switch for them:
a test installs one (``install``), which makes ``stage.runner.new_runner`` build
``FaultyRunner`` (a StageRunner subclass) instead of ``StageRunner``, in this process by
``monkeypatch`` and in every process started meanwhile (stage processes, a CLI's) through
``fault_site/sitecustomize.py``: Python imports it at the start of a process that has it on its
path, and it installs the fault there when the environment names one."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import numpy as np

import pipepool.stage.runner
from pipepool.core.media import text_media
from pipepool.core.plan import StepPlan
from pipepool.stage.mirror import StepView
from pipepool.stage.runner import StageRunner

FAULTS = (
    "skip_post_step_on_non_last_stage",  # the historical bug: every non-last stage
    "raise_on_stage",
    "wrong_block_table",
    "pool_on_non_last_stage",
    "keep_aborted_mirror",
    "drop_request",
    "sleep_on_stage",  # not a slip: a slow stage, for the watchdog (``sleeps``)
    "text_positions_on_stage",  # a vision-language stage applies 1-D positions, not M-RoPE's
)
ENV = "PIPEPOOL_TEST_FAULT"  # kind:stage:step
_SLEEPS_ENV = "PIPEPOOL_TEST_SLEEPS"  # step=seconds,step=seconds
_HERE = Path(__file__).resolve().parent
# Put first on a started process's path (PYTHONPATH, or the parent's sys.path, which stage
# processes are given), with this folder, so that the process can import this module.
_SITE = _HERE / "fault_site"


def install(
    monkeypatch, kind: str, *, stage: int = 0, step: int = 0, sleeps: dict[int, float] | None = None
) -> None:
    """From now until the test ends, engines started in this process (and their stage
    processes) commit ``kind`` on ``stage`` from step ``step`` on (``sleep_on_stage``: the
    stage sleeps ``sleeps[step_id]`` seconds before each step listed)."""
    assert kind in FAULTS, kind
    monkeypatch.setenv(ENV, f"{kind}:{stage}:{step}")
    monkeypatch.setenv(_SLEEPS_ENV, ",".join(f"{k}={v}" for k, v in (sleeps or {}).items()))
    paths = [str(_SITE), str(_HERE)]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    for path in reversed(paths[:2]):
        monkeypatch.syspath_prepend(path)
    monkeypatch.setattr(pipepool.stage.runner, "StageRunner", FaultyRunner)


def install_in_this_process() -> None:
    """``install`` for the life of a process started while a test had a fault installed
    (``fault_site/sitecustomize.py`` calls it): its stages run ``FaultyRunner``."""
    pipepool.stage.runner.StageRunner = FaultyRunner


class FaultyRunner(StageRunner):
    """A StageRunner that commits the fault named in the environment, on its stage."""

    def _load(self, config, folder, spec) -> None:
        kind, stage, step = os.environ[ENV].split(":")
        if kind == "skip_post_step_on_non_last_stage":
            on = not spec.is_last
        else:
            on = spec.index == int(stage)
        self.fault = kind if on else None
        self.fault_step = int(step)
        listed = (item.split("=") for item in os.environ.get(_SLEEPS_ENV, "").split(",") if item)
        self.sleeps = {int(k): float(v) for k, v in listed}
        super()._load(config, folder, spec)

    def execute(self, plan: StepPlan, inbound, outbound):
        if self.fault == "raise_on_stage" and plan.step_id >= self.fault_step:
            raise RuntimeError(
                f"injected failure on stage {self.spec.index} at step {plan.step_id}"
            )
        if self.fault == "sleep_on_stage":
            time.sleep(self.sleeps.get(plan.step_id, 0.0))
        if self.fault == "text_positions_on_stage" and len(plan.media):
            # Positions counted from the chunk starts as for text, as if no image were there
            # (and no placeholder read an image row).
            plan = dataclasses.replace(plan, media=text_media(plan.starts, plan.ends))
        return super().execute(plan, inbound, outbound)

    def _pools(self) -> bool:
        """``pool_on_non_last_stage``: a stage that is not the last keeps pooling state."""
        return super()._pools() or self.fault == "pool_on_non_last_stage"

    def _view(self, plan: StepPlan) -> StepView:
        """``wrong_block_table``: the tables of requests registered this step are one block
        off."""
        view = super()._view(plan)
        registered = len(view.entries) - (plan.num_reqs - len(plan.new))
        if self.fault == "wrong_block_table" and registered:
            for entry in view.entries[-registered:]:
                entry.block_ids = np.asarray(entry.block_ids) + 1
        return view

    def _post_step(self, view: StepView) -> np.ndarray:
        """The historical bug: the mirror is left behind."""
        if self.fault == "skip_post_step_on_non_last_stage":
            return view.mirror_starts.copy()
        return super()._post_step(view)

    def _drop(self, plan: StepPlan, view: StepView) -> None:
        if self.fault == "keep_aborted_mirror":  # aborted requests' mirrors are left behind
            for rid in self.mirror.drop(plan, view, freed=False):
                if self.pooler is not None:
                    self.pooler.drop(rid)
        else:
            super()._drop(plan, view)
        if self.fault == "drop_request" and plan.step_id >= self.fault_step and self.mirror.entries:
            self.mirror.entries.pop(min(self.mirror.entries))  # a request with chunks to go
