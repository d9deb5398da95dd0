"""Tracing off vs on, whole engine: the same workload through engines with tracing off and on,
alternating (off, on, on, off, ...), in one process. Reports wall tokens/s and the CPU time
per step of all the pipeline's processes: on a machine shared with other jobs the CPU time is
far less disturbed than the wall time, and it is what tracing would add to.

    python benchmarks/trace_ab.py MODEL_DIR --pp 2 --budget 2048 --requests 32 --rounds 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from pipepool import Engine
from pipepool.commands.workloads import make_workload

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """This process's CPU time and that of the stage processes ``pids``."""
    total = time.process_time()
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    folder = tempfile.mkdtemp()
    for r in range(args.rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            trace = str(Path(folder) / f"t{r}.json") if mode == "on" else None
            with Engine(args.model, pipeline_parallel_size=args.pp,
                        max_num_batched_tokens=args.budget, trace=trace) as engine:  # fmt: skip
                pids = [p.pid for p in getattr(engine.pipeline._executor, "_procs", {}).values()]
                d = engine.pipeline.deployment
                w = make_workload("W1", d.vocab_size, max_len=d.max_model_len,
                                  requests=args.requests)  # fmt: skip
                engine.pool(w.token_ids, pooling="last")  # warm-up
                for _ in range(args.passes):
                    steps, c0, t0 = engine.stats.steps, cpu_seconds(pids), time.perf_counter()
                    engine.pool(w.token_ids, pooling="last")
                    rates[mode].append(w.num_tokens / (time.perf_counter() - t0))
                    cpu[mode].append((cpu_seconds(pids) - c0) / (engine.stats.steps - steps))
            print(mode, [round(x) for x in rates[mode][-args.passes :]], "tok/s", flush=True)
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    c_off, c_on = statistics.median(cpu["off"]) * 1e3, statistics.median(cpu["on"]) * 1e3
    every = rates["off"] + rates["on"]
    print(
        f"median tok/s off {off:.0f}, on {on:.0f} ({100 * (on / off - 1):+.1f}%; spread "
        f"{min(every):.0f}-{max(every):.0f}); CPU ms per step, all processes: off "
        f"{c_off:.2f}, on {c_on:.2f} ({100 * (c_on / c_off - 1):+.1f}%)"
    )


if __name__ == "__main__":
    main()
