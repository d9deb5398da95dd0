"""When a failed pipeline is started again, and how long to wait first.

A stage process that dies (killed, out of memory, a crashed driver library) takes the pipeline
with it; the engine starts the stages again and runs the requests in flight once more. A fault
that comes back at once (a poisoned request, a broken device) would do that forever, so the
restarts are bounded: at most ``limit`` within ``window_s``, each after a delay that doubles.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RestartPolicy:
    """When to start a failed pipeline (or replica) again: at most ``limit`` restarts within
    ``window_s``, after a pause that doubles with each failure still in the window."""

    limit: int  # restarts allowed within the window; 0: never restart
    window_s: float = 300.0
    first_delay_s: float = 0.5  # doubles with each failure still in the window
    max_delay_s: float = 8.0
    failures: list[float] = field(default_factory=list)  # monotonic times, oldest first

    def on_failure(self, now: float) -> float | None:
        """Record a failure at ``now``: seconds to wait before restarting, or None to give up."""
        self.failures = [t for t in self.failures if now - t < self.window_s]
        self.failures.append(now)
        n = len(self.failures)
        if n > self.limit:
            return None
        return min(self.first_delay_s * 2 ** (n - 1), self.max_delay_s)
