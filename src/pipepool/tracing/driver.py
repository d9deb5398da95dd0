"""What the engine's loop records: its own work per step on the "loop" track (schedule,
submit, wait for the result, deliver it), and on the "pipeline" track the busy periods, from
a plan entering an empty pipeline until the pipeline has nothing in flight and nothing to
schedule: the window that the summary divides the stages' time over."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .recorder import ProcessTrace, Recorder, Span, now

if TYPE_CHECKING:
    from ..core.plan import StepPlan


class DriverTrace:
    """The engine loop's recorder (its thread only)."""

    def __init__(self) -> None:
        self.recorder = Recorder("driver", sort=0)
        self._period_start: int | None = None

    def span(self, name: str, start_ns: int, plan: StepPlan, end_ns: int | None = None) -> int:
        """Record ``name`` from ``start_ns`` to now for ``plan``; returns now (the next span's
        start)."""
        end = now() if end_ns is None else end_ns
        rec = self.recorder
        rec.span("loop", name, start_ns, end, plan.step_id, plan.num_tokens, plan.num_reqs)
        return end

    def submitted(self, start_ns: int) -> None:
        """A plan entered the pipeline (at ``start_ns``, when it was scheduled)."""
        if self._period_start is None:
            self._period_start = start_ns

    def drained(self, end_ns: int) -> None:
        """No plan in flight any more: a busy period ends."""
        if self._period_start is not None:
            self.recorder.span("pipeline", "in flight", self._period_start, end_ns)
            self._period_start = None

    def export(self) -> ProcessTrace:
        extra = []
        if self._period_start is not None:  # gathered mid-run: the period so far
            extra.append(Span("pipeline", "in flight", self._period_start, now(), -1, 0, 0))
        return self.recorder.export(extra)
