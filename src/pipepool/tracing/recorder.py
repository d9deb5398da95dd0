"""One process's spans, on the host's monotonic clock.

``time.monotonic_ns`` reads CLOCK_MONOTONIC on Linux, one clock for every process of a host:
spans of stage processes on the driver's host need no offset at all. Processes on other hosts
are aligned once, when the driver gathers their spans (``clock.py``).
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import NamedTuple

now = time.monotonic_ns

# A server traces for as long as it runs: each process keeps its newest spans only
# (about 100 bytes each in memory, as in the file).
MAX_SPANS = 200_000


class Span(NamedTuple):
    """One timed interval of a process's step timeline, on that process's monotonic clock."""

    track: str  # a lane of the process: "host", "device", "loop", "pipeline"
    name: str  # what happened: "forward", "wait input", "schedule", ...
    start_ns: int  # on the process's clock (ProcessTrace.offset_ns moves it to the driver's)
    end_ns: int
    step: int  # step id, -1 for none
    tokens: int  # tokens of the step
    reqs: int  # requests of the step


@dataclass(frozen=True)
class ProcessTrace:
    """The spans of one process (or of one in-process stage), ready to merge."""

    name: str  # "driver", "stage 0", ...
    sort: int  # place among the processes in the viewer (driver 0, stage k at k + 1)
    host_id: str  # processes with the same host_id share one clock
    spans: list[Span] = field(default_factory=list)
    offset_ns: int = 0  # add to this process's times to read them on the driver's clock

    def aligned(self, offset_ns: int) -> ProcessTrace:
        return replace(self, offset_ns=offset_ns)


def host_id() -> str:
    """Who shares our CLOCK_MONOTONIC: the same machine since the same boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = str(os.getpid())  # unknown: assume a clock of our own
    return f"{socket.gethostname()}/{boot}"


class Recorder:
    """Spans of one process, newest ``max_spans`` kept. ``span`` appends one tuple: the cost of
    a trace point is a clock read and an append."""

    def __init__(self, name: str, sort: int, *, max_spans: int = MAX_SPANS) -> None:
        self.name, self.sort = name, sort
        # Plain tuples, made Spans on export: a NamedTuple's constructor is half the cost.
        self._spans: deque[tuple] = deque(maxlen=max_spans)

    def span(
        self, track: str, name: str, start_ns: int, end_ns: int, step: int = -1,
        tokens: int = 0, reqs: int = 0,
    ) -> None:  # fmt: skip
        self._spans.append((track, name, start_ns, end_ns, step, tokens, reqs))

    def export(self, extra: list[Span] | None = None) -> ProcessTrace:
        spans = [Span._make(s) for s in self._spans] + (extra or [])
        return ProcessTrace(self.name, self.sort, host_id(), spans)
