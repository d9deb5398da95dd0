"""``IntakePacer``: how callers enqueueing a call's slices and the loop thread share the host.

Both need the GIL. A call whose inputs come in several slices (``Engine.submit`` tokenises and
enqueues a slice at a time) waits after each slice while the backlog — tokens enqueued and in
no plan handed to the stages yet — holds a whole step, so the loop thread is not starved; and
the loop, short of a step while such a call is still enqueueing, waits briefly for its next
slice rather than send a short step. Why, with the measurements:
docs/benchmarks/gpu-short-inputs.md.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

# The longest a caller enqueueing a call's slices waits for the backlog to fall below a step
# (``intake``): a bound, not a pace; the backlog falls at every step.
_PACE_S = 0.05
# A step that starts an idle pipeline holds at most this share of the step budget where steps
# overlap (``overlap_steps``, CUDA's default): the device starts sooner, and the next step, a
# whole one, is built while this one runs (docs/benchmarks/gpu-short-inputs.md).
_IDLE_STEP_SHARE = 0.5


class IntakePacer:
    """The backlog count and the slicing calls of one pipeline.

    Shares the pipeline's lock: every method but ``intake`` is called with it held (by the
    loop thread, or by a caller enqueueing); ``intake`` takes it. ``ended()`` says the pipeline
    stopped or died: no caller waits on it then."""

    def __init__(
        self,
        lock: threading.RLock,
        step_tokens: int,
        overlap_steps: bool,
        ended: Callable[[], bool],
    ) -> None:
        self._room = threading.Condition(lock)  # a step took from the backlog
        self._step_tokens = step_tokens
        self._overlap_steps = overlap_steps
        self._ended = ended
        self.backlog_tokens = 0  # enqueued, and not yet in a plan handed to the stages
        self.plans_handed_over = 0  # since the pipeline started
        self.slicing = 0  # calls still enqueueing slices

    @contextlib.contextmanager
    def intake(self, wake: threading.Condition) -> Iterator[Callable[[], object]]:
        """Around the enqueueing of a call's slices: yields what the caller runs after each
        slice — after the first, a wait (5 ms at most) until a step is with the stages; after
        each, a wait (``_PACE_S`` at most) while the backlog holds a whole step. ``wake``: the
        loop's condition, notified when the call ends."""
        with wake:
            self.slicing += 1
            handed_before = self.plans_handed_over
        first = True

        def enqueued() -> None:
            nonlocal first
            with wake:
                if first:
                    first = False
                    self._room.wait_for(
                        lambda: self.plans_handed_over > handed_before or self._ended(), 0.005
                    )
                self._room.wait_for(
                    lambda: self.backlog_tokens < self._step_tokens or self._ended(), _PACE_S
                )

        try:
            yield enqueued
        finally:
            with wake:
                self.slicing -= 1
                wake.notify()

    def short_of_a_step(self) -> bool:
        """Whether a call is still enqueueing slices while less than a step's budget is
        queued: a step scheduled now would be short, and a short step costs the host as much
        as a full one while giving a small model's device less to do."""
        return bool(self.slicing) and self.backlog_tokens < self._step_tokens

    def idle_step_tokens(self) -> int | None:
        """The budget of a step scheduled while no step is in flight (``_IDLE_STEP_SHARE``);
        None (the whole budget) where steps do not overlap (the CPU: the driver computes stage
        0 itself, so nothing of the next step is built while a step runs)."""
        if not self._overlap_steps:
            return None
        return int(self._step_tokens * _IDLE_STEP_SHARE)

    def handed_over(self, tokens: int) -> None:
        """A plan of ``tokens`` is with the stages: they leave the backlog."""
        self.backlog_tokens -= tokens
        self.plans_handed_over += 1
        self._room.notify_all()

    def release_waiters(self) -> None:
        """The pipeline ended: callers waiting on the backlog go on (and find it dead)."""
        self._room.notify_all()
