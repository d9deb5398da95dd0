"""Progress of a long command over the lines of a file, printed to stderr: a line at most every
``every_s`` seconds as results arrive, and one at the end (not a bar: the output is often a
log file)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class LineProgress:
    """Counts answered and failed lines of ``total`` (``done`` of them answered before this
    run) and prints ``name: answered/total lines (pct), failed, rate`` to ``out`` when
    ``every_s`` has passed since the last print, and at ``finish()``. Not thread-safe: called
    from one thread (the loop that writes the results)."""

    def __init__(
        self, name: str, total: int, done: int = 0, every_s: float = 5.0, out: TextIO | None = None
    ) -> None:
        self.name, self.total, self.every_s = name, total, every_s
        self.out = sys.stderr if out is None else out
        self.done_before = done
        self.answered = self.failed = 0
        self.started = self.printed = time.monotonic()

    def add(self, answered: int, failed: int) -> None:
        """Count ``answered`` (2xx) and ``failed`` lines just written."""
        self.answered += answered
        self.failed += failed
        if time.monotonic() - self.printed >= self.every_s:
            self._print()

    def finish(self) -> None:
        """Print the final counts."""
        self._print()

    def _print(self) -> None:
        now = time.monotonic()
        self.printed = now
        this_run = self.answered + self.failed
        written = self.done_before + this_run
        share = f" ({100 * written / self.total:.1f}%)" if self.total else ""
        rate = this_run / max(now - self.started, 1e-9)
        print(
            f"{self.name}: {written:,}/{self.total:,} lines{share}, {self.failed:,} failed, "
            f"{rate:,.1f} lines/s",
            file=self.out,
            flush=True,
        )
