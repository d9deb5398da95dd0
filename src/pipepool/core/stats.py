"""Counters the engine keeps for metrics, benchmarks and the CLI summary."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field, replace

from .plan import StepPlan, StepResult

# Step-time histogram buckets (seconds), Prometheus style (cumulative "le").
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class EngineStats:
    """Counters of one engine (requests, tokens, steps, restarts, step-time histogram, busy
    seconds per stage), updated by its loop thread and read by anyone (metrics, replicas'
    snapshots); a read may see one step's updates half applied."""

    num_stages: int
    requests_submitted: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    prompt_tokens_submitted: int = 0
    prompt_tokens_finished: int = 0
    steps: int = 0
    scheduled_tokens: int = 0
    chunked_requests: int = 0  # requests whose prompt took more than one step
    queue_waiting: int = 0
    requests_running: int = 0
    pipeline_restarts: int = 0  # failed pipelines started again
    requests_retried: int = 0  # unfinished requests run again after a restart
    step_time_sum: float = 0.0
    step_time_count: int = 0
    step_time_buckets: list[int] = field(default_factory=lambda: [0] * len(STEP_BUCKETS))
    stage_busy_s: list[float] = field(default_factory=list)  # cumulative, per stage
    # What stages had computed before the last restart: a restarted stage counts from zero.
    _busy_before: list[float] = field(default_factory=list, repr=False)
    _raw_busy: list[float] = field(default_factory=list, repr=False)  # as last reported
    errors: Counter = field(default_factory=Counter)  # by exception class name
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def snapshot(self) -> EngineStats:
        """A copy of the counters as they are now, which later updates leave alone."""
        with self._lock:
            return replace(
                self,
                step_time_buckets=list(self.step_time_buckets),
                stage_busy_s=list(self.stage_busy_s),
                _busy_before=list(self._busy_before),
                _raw_busy=list(self._raw_busy),
                errors=Counter(self.errors),
                _lock=threading.Lock(),
            )

    def on_submit(self, n: int, tokens: int) -> None:
        with self._lock:
            self.requests_submitted += n
            self.prompt_tokens_submitted += tokens

    def on_plan(self, plan: StepPlan) -> None:
        with self._lock:
            self.steps += 1
            self.scheduled_tokens += plan.num_tokens
            first_chunk_ends = plan.ends[plan.num_reqs - len(plan.new) :]
            self.chunked_requests += int((first_chunk_ends < plan.new.prompt_lens).sum())

    def on_result(self, plan: StepPlan, result: StepResult, wait_s: float) -> None:
        """``wait_s``: how long the driver waited for the result. The step's time is the
        device time its stages report (the slowest stage's share of the step): the driver's
        wait says little, as a one-process CPU pipeline computes while the plan is submitted
        and the wait is then ~0."""
        with self._lock:
            step_s = wait_s
            if result.stage_busy_s:
                raw = list(result.stage_busy_s)  # each stage's busy time since it started
                same = len(self._raw_busy) == len(raw)
                last = self._raw_busy if same else [0.0] * len(raw)
                step_s = max(now - then for now, then in zip(raw, last, strict=True))
                self._raw_busy = raw
                before = self._busy_before or [0.0] * len(raw)
                self.stage_busy_s = [b + s for b, s in zip(before, raw, strict=True)]
            self.step_time_sum += step_s
            self.step_time_count += 1
            for i, bound in enumerate(STEP_BUCKETS):
                if step_s <= bound:
                    self.step_time_buckets[i] += 1

    def on_finish(self, requests: int, tokens: int) -> None:
        with self._lock:
            self.requests_finished += requests
            self.prompt_tokens_finished += tokens

    def on_abort(self, requests: int) -> None:
        with self._lock:
            self.requests_aborted += requests

    def on_error(self, exc: BaseException) -> None:
        with self._lock:
            self.errors[type(exc).__name__] += 1

    def on_restart(self) -> None:
        with self._lock:
            self.pipeline_restarts += 1
            self._busy_before = list(self.stage_busy_s)
            self._raw_busy = []

    def on_retry(self, requests: int) -> None:
        with self._lock:
            self.requests_retried += requests

    def set_queue(self, waiting: int, unfinished: int) -> None:
        self.queue_waiting = waiting
        self.requests_running = unfinished - waiting
