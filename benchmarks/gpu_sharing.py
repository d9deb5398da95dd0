"""A light model's latency while a heavy model keeps the same GPU busy: in another process (as
``pipepool serve`` places several models today), and in the same process.

Issue 35 found the other models' p99 at 7-18x idle while one model was flooded, with the server's
front end far from saturated; the suspect left was the GPU itself, which runs kernels of
different processes by turns of a time slice, but those of one process's streams side by side.
This measures that without HTTP: the light engine (all-MiniLM-L6-v2 shape) answers one
10-token request at a time, back to back, for ``--seconds``:

1. idle: nothing else on the GPU;
2. another process: a heavy engine (Qwen3-0.6B shape) embeds W1-like batches without pause;
3. this process: the same heavy engine, driven by a thread of this process.

Prints p50 / p99 / max latency per phase and the heavy engine's tokens/s where it ran.

    python3 benchmarks/gpu_sharing.py [--seconds 15] [--heavy-batch 512]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_suite

from pipepool import Engine
from pipepool.commands.workloads import make_workload

KV_TOKENS = 1 << 16


def run_heavy(path: str, batch: int, stop: threading.Event, ready, counted: list[float]) -> None:
    """Embed one W1-like batch over and over until ``stop`` (``ready()`` once compiled and
    warm); [tokens, seconds] into ``counted``."""
    # A KV cache of a few steps' tokens, not most of the GPU: the light engine shares it.
    with Engine(path, kv_cache_tokens=KV_TOKENS) as engine:
        engine.pipeline.wait_until_compiled(None)
        inputs = [ids.tolist() for ids in make_workload("W1", 30000, max_len=512,
                                                        requests=batch).token_ids]  # fmt: skip
        tokens = sum(len(ids) for ids in inputs)
        engine.embed(inputs)
        ready()
        start = time.perf_counter()
        done = 0
        while not stop.is_set():
            engine.embed(inputs)
            done += tokens
        counted[:] = [done, time.perf_counter() - start]


def light_latencies(engine: Engine, seconds: float) -> np.ndarray:
    request = [list(range(2000, 2010))]
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        engine.embed(request)
        times.append(time.perf_counter() - t0)
    return np.array(times) * 1e3


def report(phase: str, ms: np.ndarray, heavy: list[float] | None = None) -> None:
    line = (
        f"{phase:>16}: {len(ms):6d} requests  p50 {np.percentile(ms, 50):7.2f} ms  "
        f"p99 {np.percentile(ms, 99):7.2f} ms  max {ms.max():7.1f} ms"
    )
    if heavy:
        line += f"  heavy {heavy[0] / heavy[1]:,.0f} tokens/s"
    print(line, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--heavy-batch", type=int, default=512)
    parser.add_argument("--serve-heavy", help=argparse.SUPPRESS)  # the other process's role
    args = parser.parse_args()
    if args.serve_heavy:
        stop = threading.Event()
        threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
        counted: list[float] = []
        busy = lambda: print("heavy: busy", flush=True)  # noqa: E731
        run_heavy(args.serve_heavy, args.heavy_batch, stop, busy, counted)
        print(f"heavy: {counted[0]:.0f} {counted[1]:.3f}", flush=True)
        return 0

    light_path = str(gpu_suite.build_checkpoint("minilm"))
    heavy_path = str(gpu_suite.build_checkpoint("0.6b"))
    with Engine(light_path) as light:
        light.pipeline.wait_until_compiled(None)
        light_latencies(light, 2.0)  # warm
        report("idle", light_latencies(light, args.seconds))

        other = subprocess.Popen(
            [sys.executable, __file__, "--serve-heavy", heavy_path,
             "--heavy-batch", str(args.heavy_batch)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ,
        )  # fmt: skip
        assert other.stdout is not None and other.stdin is not None
        for line in other.stdout:
            if line.startswith("heavy: busy"):
                break
        ms = light_latencies(light, args.seconds)
        other.stdin.close()  # the other process stops after its batch in flight
        heavy = [float(x) for x in other.stdout.read().split("heavy:")[-1].split()]
        other.wait()
        report("other process", ms, heavy)

        stop, counted = threading.Event(), []
        ready = threading.Event()
        thread = threading.Thread(
            target=run_heavy, args=(heavy_path, args.heavy_batch, stop, ready.set, counted)
        )
        thread.start()
        ready.wait()
        ms = light_latencies(light, args.seconds)
        stop.set()
        thread.join()
        report("same process", ms, counted)
        report("idle again", light_latencies(light, args.seconds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
