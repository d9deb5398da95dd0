"""``StepWatchdog``: a pipeline whose step result is overdue is declared hung.

A stage process that stops answering (SIGSTOP, a deadlock, a wedged device) leaves the loop
thread waiting for a result that never comes, and every request with it, while the stage still
looks alive. The watchdog bounds that wait: each plan handed to the stages gets a deadline,
``step_timeout_s`` plus 10 ms per token of the plan, and a thread of its own declares the
pipeline hung once the oldest deadline passes; the stage processes are then killed, and the
loop heals the pipeline as for a killed stage (restart, every unfinished request run again).
The first plan of a pipeline (after start or a restart) gets no deadline: it may compile.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

_CHECK_S = 0.1  # how often the oldest deadline is looked at
_PER_TOKEN_S = 0.01


class StepWatchdog:
    """Deadlines of the plans in flight, oldest first. The loop thread reports each plan
    handed over (``submitted``) and each result (``collected``); ``on_overdue(reason)`` runs
    on the watchdog's thread, at most once per pipeline (``reset`` starts a new one).
    ``timeout_s`` 0: never fires (no thread is started)."""

    def __init__(self, timeout_s: float, on_overdue: Callable[[str], None]) -> None:
        self._timeout_s = timeout_s
        self._on_overdue = on_overdue
        self._lock = threading.Lock()
        self._deadlines: deque[tuple[float, float]] = deque()  # (deadline, handed over at)
        self._armed = False  # a result came back from this pipeline
        self._fired = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="pipepool-watchdog",
                                            daemon=True)  # fmt: skip
            self._thread.start()

    def submitted(self, tokens: int) -> None:
        now = time.monotonic()
        budget = self._timeout_s + _PER_TOKEN_S * tokens if self._armed else math.inf
        with self._lock:
            self._deadlines.append((now + budget, now))

    def collected(self) -> None:
        with self._lock:
            if self._deadlines:
                self._deadlines.popleft()
            self._armed = True

    def reset(self) -> None:
        """A fresh pipeline: nothing in flight, no deadline until its first result."""
        with self._lock:
            self._deadlines.clear()
            self._armed = False
            self._fired = False

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(_CHECK_S):
            with self._lock:
                if self._fired or not self._deadlines:
                    continue
                deadline, since = self._deadlines[0]
                now = time.monotonic()
                if now <= deadline:
                    continue
                self._fired = True
            self._on_overdue(
                f"no step result for {now - since:.1f} s (step_timeout_s={self._timeout_s:g} "
                "plus 10 ms a token): the stage processes are hung"
            )
