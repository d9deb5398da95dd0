"""How many threads of the host are runnable at once, sampled until stopped (SIGTERM).

    python benchmarks/runnable_threads.py > runq.log & ...; kill %1

Reads ``/proc/loadavg``'s running-entities count every 50 ms and, when stopped, prints its
median, 90th percentile and maximum per 5 s window: more runnable threads than cores means
threads waiting for a core (issue 35's flood: docs/benchmarks/several-models.md).
"""

from __future__ import annotations

import signal
import sys
import time

SAMPLE_S, WINDOW_S = 0.05, 5


def summary(samples: list[tuple[float, int]]) -> list[str]:
    windows: dict[int, list[int]] = {}
    for t, runnable in samples:
        windows.setdefault(int(t // WINDOW_S) * WINDOW_S, []).append(runnable)
    start = min(windows, default=0)
    lines = []
    for key in sorted(windows):
        v = sorted(windows[key])
        lines.append(
            f"t={key - start:4d}s n={len(v)} p50={v[len(v) // 2]} "
            f"p90={v[int(len(v) * 0.9)]} max={v[-1]}"
        )
    return lines


def main() -> None:
    samples: list[tuple[float, int]] = []

    def done(*_) -> None:
        print("\n".join(summary(samples)), flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, done)
    while True:
        with open("/proc/loadavg") as f:
            samples.append((time.time(), int(f.read().split()[3].split("/")[0])))
        time.sleep(SAMPLE_S)


if __name__ == "__main__":
    main()
