"""Where the host's time goes while the engine runs a workload, and when the device waits.

    python3 benchmarks/host_time.py minilm W4 [--budget 65536] [--switch-interval-ms 5]

KEY is a checkpoint of ``gpu_suite.py`` (random weights from the real config, bf16 on CUDA);
on a machine without CUDA, use ``--model DIR`` (fp32). ``--stub-forward`` replaces the layers'
forward by zeros, so that on the CPU the host's own work per step (scheduling, inputs, the
digest chain, pooling, delivery) is what is left to time. Three parts, one engine, default
settings unless given:

1. passes timed without any instrument: milliseconds a pass and a step, tokens/s; then (CUDA)
   the device's busy time from torch.profiler's kernels over five more passes, as a share of
   their wall and of an unprofiled pass's (the profiler slows a host-bound pass);
2. one pass of a second engine with the step timeline on (``trace=``, which costs the host a
   few microseconds a span): every gap of 20 us or more in which the device ran none of a
   step's work, from the call to the first step, between steps and after the last;
3. the passes of part 1 with every host function of the loop thread wrapped in a timer:
   milliseconds a step each (inclusive, so nested ones overlap; a wrapper costs ~1 us a call).
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import json
import os
import statistics
import tempfile
import time

import gpu_suite
import torch

import pipepool
from pipepool.commands.workloads import gpu_busy, make_workload

# (module, function or Class.method): the loop thread's host work, stage side and driver side.
WRAPPED = [
    ("pipepool.core.scheduler", "Scheduler.schedule"),
    ("pipepool.core.scheduler", "Scheduler.update"),
    ("pipepool.core.scheduler", "expected_parts"),
    ("pipepool.parallel.executor", "UniprocExecutor.submit"),
    ("pipepool.parallel.executor", "UniprocExecutor.collect"),
    ("pipepool.driver.local", "LocalPipeline._deliver"),
    ("pipepool.driver.local", "LocalPipeline.enqueue"),
    ("pipepool.stage.runner", "StageRunner._forward"),
    ("pipepool.stage.runner", "StageRunner._digest"),
    ("pipepool.stage.runner", "build_host_batch"),
    ("pipepool.stage.runner", "to_step_inputs"),
    ("pipepool.stage.batch", "DeviceUploader.upload"),
    ("pipepool.stage.pooling", "Pooler.prepare"),
    ("pipepool.stage.pooling", "Pooler.pool"),
    ("pipepool.stage.mirror", "Mirror.view"),
    ("pipepool.core.digest", "StageState.parts"),
    ("pipepool.stage.cuda_graphs", "GraphedForward.__call__"),
    ("pipepool.stage.cuda_graphs", "_Attention.run"),
    ("pipepool.stage.output", "PendingResult.result"),
]


def wrap_all(spent: collections.Counter, calls: collections.Counter) -> None:
    for module_name, qualified in WRAPPED:
        module = importlib.import_module(module_name)
        owner, name = module, qualified
        if "." in qualified:
            cls, name = qualified.split(".")
            owner = getattr(module, cls)
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*args, _fn=fn, _key=qualified, **kwargs):
            start = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[_key] += time.perf_counter() - start
                calls[_key] += 1

        setattr(owner, name, timed)


class ZeroLayers:
    """A stage's forward that answers at once: rows of one zero buffer, grown when a step
    needs more (zeroing a fresh [T, H] every step would be work of its own)."""

    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        self.zeros = torch.zeros(0, hidden, dtype=dtype)

    def __call__(self, x: torch.Tensor, inputs, kv) -> torch.Tensor:
        if len(self.zeros) < len(x):
            self.zeros = torch.zeros(len(x), self.zeros.shape[1], dtype=self.zeros.dtype)
        return self.zeros[: len(x)]


def stub_forward(engine: pipepool.Engine) -> None:
    """Every in-process stage's layers answer zeros at once (``ZeroLayers``)."""
    for runner in engine.pipeline.runners:
        runner.forward = ZeroLayers(runner.model.hidden_size, runner.spec.dtype)


def device_gaps(trace_file: str, window: tuple[int, int]) -> list[tuple[str, float]]:
    """(where, milliseconds) of every stretch of 20 us or more without the device's work of a
    step ("busy" spans: CUDA events on CUDA, the compute itself on the CPU) inside ``window``
    (``time.monotonic_ns()`` of the call's start and of its result)."""
    with open(trace_file) as f:
        data = json.load(f)
    # The file's times count from its first span; the window's from the call.
    shift_us = (data["otherData"]["origin_ns"] - window[0]) / 1e3
    busy = sorted(
        (e["ts"] + shift_us, e["ts"] + shift_us + e["dur"], e["args"].get("step"))
        for e in data["traceEvents"]
        if e.get("ph") == "X" and e.get("cat") == "busy"
    )
    pass_us = (window[1] - window[0]) / 1e3
    gaps, end, first = [], 0.0, None
    for start, stop, step in busy:
        first = step if first is None else first
        if start - end >= 20:
            where = "before the first step" if end == 0 else f"before step {step - first + 1}"
            gaps.append((where, (start - end) / 1e3))
        end = max(end, stop)
    gaps.append(("after the last step", (pass_us - end) / 1e3))
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("key", nargs="?", default="minilm", help="gpu_suite.py checkpoint")
    parser.add_argument("workload", nargs="?", default="W4")
    parser.add_argument("--model", help="a model folder instead of a gpu_suite.py checkpoint")
    parser.add_argument("--budget", type=int, help="max_num_batched_tokens")
    parser.add_argument("--switch-interval-ms", type=float, help="the engine option")
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--stub-forward", action="store_true", help="layers answer zeros")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    path = args.model or str(gpu_suite.build_checkpoint(args.key))
    options: dict = {"dtype": "bfloat16"} if cuda else {}
    if args.key == "minilm" or args.model:
        options["max_model_len"] = 512
    if args.budget:
        options["max_num_batched_tokens"] = args.budget
    if args.switch_interval_ms is not None:
        options["switch_interval_ms"] = args.switch_interval_ms
    engine = pipepool.Engine(path, **options)
    engine.pipeline.wait_until_compiled(None)
    if args.stub_forward:
        stub_forward(engine)
    d = engine.pipeline.deployment
    workload = make_workload(args.workload, d.vocab_size, max_len=d.max_model_len)

    def one_pass(engine: pipepool.Engine = engine) -> None:
        engine.submit(workload.token_ids, pooling=d.pooling, normalize=True).result()

    def timed_passes() -> tuple[float, float]:
        steps = engine.stats.steps
        seconds = []
        for _ in range(args.passes):
            start = time.perf_counter()
            one_pass()
            seconds.append(time.perf_counter() - start)
        return statistics.median(seconds), (engine.stats.steps - steps) / args.passes

    for _ in range(3):  # compile, graphs of every step size, allocator
        one_pass()
    # 1. Nothing instrumented.
    pass_s, steps = timed_passes()
    print(
        f"{args.key} {args.workload} {options}: {pass_s * 1e3:.1f} ms a pass (median of "
        f"{args.passes}), {steps:.1f} steps, {pass_s / steps * 1e3:.2f} ms a step, "
        f"{workload.num_tokens / pass_s / 1e6:.3f}M tok/s"
    )
    if cuda:
        busy = gpu_busy(one_pass, passes=5)
        print(
            f"GPU busy {busy.busy_s / busy.passes * 1e3:.1f} ms a pass: {busy.fraction:.3f} of "
            f"{busy.passes} profiled passes' wall ({busy.profiled_wall_s * 1e3:.1f} ms), "
            f"{busy.fraction_of(pass_s):.3f} of an unprofiled pass ({pass_s * 1e3:.1f} ms)"
        )
    # 2. One pass's timeline, from an engine that records one: where the device waited.
    trace_file = os.path.join(tempfile.mkdtemp(), "host_time.json")
    with pipepool.Engine(path, trace=trace_file, **options) as traced:
        traced.pipeline.wait_until_compiled(None)
        if args.stub_forward:
            stub_forward(traced)
        for _ in range(3):
            one_pass(traced)
        since = time.monotonic_ns()
        one_pass(traced)
        until = time.monotonic_ns()
        traced.write_trace(trace_file, since_ns=since, until_ns=until)
    gaps = device_gaps(trace_file, (since, until))
    print(f"device waiting in one traced pass of {(until - since) / 1e6:.1f} ms:")
    for where, ms in gaps:
        print(f"  {ms:6.2f} ms {where}")
    print(f"  {sum(ms for _, ms in gaps):6.2f} ms in all")
    # 3. Host functions timed.
    spent, calls = collections.Counter(), collections.Counter()
    wrap_all(spent, calls)
    wrapped_s, wrapped_steps = timed_passes()
    total_steps = wrapped_steps * args.passes
    print(f"host functions, ms a step (inclusive; this part's pass: {wrapped_s * 1e3:.1f} ms):")
    for key, seconds in spent.most_common():
        per_step = calls[key] / total_steps
        print(f"  {seconds / total_steps * 1e3:7.3f}  {key} ({per_step:.1f} calls a step)")
    engine.close()


if __name__ == "__main__":
    main()
