"""``StepWatchdog``: a pipeline that keeps the loop waiting too long is declared hung.

A stage process that stops answering (SIGSTOP, a deadlock, a wedged device) leaves the loop
thread waiting on the stages (handing a plan over, or collecting a result) while the stage
still looks alive, and every request waits with it. The watchdog bounds each such wait; a
thread of its own declares the pipeline hung once the current wait outlives its bound; the
stage processes are then killed, and the loop heals the pipeline as for a killed stage
(restart, every unfinished request run again).

The bound of a wait (``WaitBound``): by default it is learnt from the waits the pipeline has
already seen, so a stopped stage is seen in seconds on a fast pipeline while a slow one (an 8B
model on the CPU) keeps room for its long steps; ``step_timeout_s`` set gives a fixed bound.
Waits before a pipeline's first result are never bounded: its first steps may compile.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

_CHECK_S = 0.1  # how often the current wait is looked at


@dataclass
class WaitBound:
    """How long one wait on the stages may last, in seconds.

    Learnt (``fixed_s`` None): ``max(FLOOR_S, MULTIPLE x the longest wait expected)``, where the
    wait expected is the longest of the last ``WINDOW`` waits, or, for a plan of more tokens than
    any of them had, the longest wait of the largest plan seen scaled up to this one's tokens.
    The first ``WARMUP`` results after a (re)start or a background compile get at least
    ``WARMUP_S`` (first runs of new shapes may compile kernels); before the first result a wait
    has no bound. Fixed (``fixed_s``, the ``step_timeout_s`` option): ``fixed_s`` plus 10 ms per
    token of the largest plan waited on. ``fixed_s`` 0: no bound."""

    fixed_s: float | None = None
    FLOOR_S = 10.0
    MULTIPLE = 10.0
    WINDOW = 256
    WARMUP = 8
    WARMUP_S = 60.0
    PER_TOKEN_S = 0.01  # the fixed bound's allowance
    results: int = 0  # since the pipeline (re)started or compiled
    _waits: deque[tuple[int, float]] = field(default_factory=deque)  # (tokens, seconds)

    @property
    def never(self) -> bool:
        return self.fixed_s == 0

    def restart(self) -> None:
        """A fresh pipeline: nothing learnt about it yet."""
        self._waits.clear()
        self.results = 0

    def rewarm(self) -> None:
        """The stages just installed compiled code: give the next results warm-up room."""
        self.results = min(self.results, 1)

    def observed(self, tokens: int, seconds: float) -> None:
        """A wait for a plan of ``tokens`` ended after ``seconds``."""
        if self.results > 0:  # the waits before the first result may have compiled
            self._waits.append((tokens, seconds))
            if len(self._waits) > self.WINDOW:
                self._waits.popleft()

    def seconds(self, tokens: int) -> float:
        """The bound of a wait for plans of at most ``tokens`` tokens."""
        if self.results == 0 or self.fixed_s == 0:
            return math.inf
        if self.fixed_s is not None:
            return self.fixed_s + self.PER_TOKEN_S * tokens
        bound = max(self.FLOOR_S, self.MULTIPLE * self._expected(tokens))
        return max(bound, self.WARMUP_S) if self.results <= self.WARMUP else bound

    def _expected(self, tokens: int) -> float:
        if not self._waits:
            return 0.0
        longest = max(s for _, s in self._waits)
        largest = max(n for n, _ in self._waits)
        if tokens <= largest or largest == 0:
            return longest
        of_largest = max(s for n, s in self._waits if n == largest)
        return max(longest, of_largest * tokens / largest)

    def rule(self) -> str:
        if self.fixed_s is not None:
            return f"step_timeout_s={self.fixed_s:g} plus 10 ms a token"
        return (
            f"learnt: max({self.FLOOR_S:g} s, {self.MULTIPLE:g} x the longest of the last "
            f"{len(self._waits)} waits)"
        )


class StepWatchdog:
    """Bounds each wait of the loop thread on the stages. The loop reports each wait's start
    (``waiting``, with the largest plan in flight) and end (``waited``), and each result
    (``collected``); ``on_overdue(reason)`` runs on the watchdog's thread, at most once per
    pipeline (``reset`` starts a new one). ``timeout_s`` 0: never fires (no thread is started);
    None: the learnt bound (``WaitBound``)."""

    def __init__(self, timeout_s: float | None, on_overdue: Callable[[str], None]) -> None:
        self._bound = WaitBound(timeout_s)
        self._on_overdue = on_overdue
        self._lock = threading.Lock()
        self._wait: tuple[float, float, int] | None = None  # (since, bound, tokens)
        self._fired = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if not self._bound.never:
            self._thread = threading.Thread(target=self._watch, name="pipepool-watchdog",
                                            daemon=True)  # fmt: skip
            self._thread.start()

    def waiting(self, tokens: int) -> None:
        """The loop thread now waits on the stages, for plans of at most ``tokens`` tokens."""
        with self._lock:
            self._wait = (time.monotonic(), self._bound.seconds(tokens), tokens)

    def waited(self) -> None:
        """The wait begun by ``waiting`` is over (answered, or failed)."""
        with self._lock:
            if self._wait is not None:
                since, _, tokens = self._wait
                self._bound.observed(tokens, time.monotonic() - since)
                self._wait = None

    def collected(self) -> None:
        """A step result came back."""
        with self._lock:
            self._bound.results += 1

    def compiled(self) -> None:
        """The stages installed compiled code: its first runs get warm-up room."""
        with self._lock:
            self._bound.rewarm()

    def reset(self) -> None:
        """A fresh pipeline: nothing waited on, no bound until its first result."""
        with self._lock:
            self._wait = None
            self._bound.restart()
            self._fired = False

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(_CHECK_S):
            with self._lock:
                if self._fired or self._wait is None:
                    continue
                since, bound, _ = self._wait
                waited = time.monotonic() - since
                if waited <= bound:
                    continue
                self._fired = True
                rule = self._bound.rule()
            self._on_overdue(
                f"no answer from the stages for {waited:.1f} s (bound {bound:.1f} s, {rule}): "
                "the stage processes are hung"
            )
