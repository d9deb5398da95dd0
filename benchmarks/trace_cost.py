"""What tracing adds to a step's host work, measured directly (a whole-engine A/B on a shared
machine is noisier than the effect): the recording calls that the driver, a first stage and a
last stage make for one step, with a real plan, repeated.

    python benchmarks/trace_cost.py [--steps 20000] [--cuda]

``--cuda`` times the device spans with CUDA events (as a GPU stage does) instead of the host
clock.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from pipepool.core.plan import StepPlan
from pipepool.stage.transport import LocalLink
from pipepool.tracing.driver import DriverTrace
from pipepool.tracing.recorder import now
from pipepool.tracing.stage import StageTrace, traced


def one_step(driver: DriverTrace, first: StageTrace, last: StageTrace, plan, link) -> None:
    """The calls of LocalPipeline._serve, StageRunner.execute and the worker loop, in order."""
    t0 = now()
    driver.submitted(t0)
    t0 = driver.span("schedule", t0, plan)
    first.begin_step(plan)  # stage 0 (in the driver process)
    _, outbound = traced(first, None, link)
    first.phase("compute")
    mark = first.begin_device()
    first.end_device(mark, "forward")
    first.phase("send")
    outbound.send_hidden(None)
    first.phase("post-step")
    outbound.send_digest(plan.step_id, plan.ends, [0.0])
    first.phase(None)
    t0 = driver.span("submit", t0, plan)
    waiting = now()  # last stage (its own process)
    last.waited_plan(waiting, plan)
    last.begin_step(plan)
    inbound, _ = traced(last, link, None)
    incoming = inbound.post(plan)
    last.phase("receive")
    incoming.hidden()
    last.phase("compute")
    mark = last.begin_device()
    last.end_device(mark, "forward")
    mark = last.begin_device()
    last.end_device(mark, "pool")
    last.phase("post-step")
    incoming.stage_busy_s()
    last.phase(None)
    last.host("result", now())
    t0 = driver.span("wait result", t0, plan)
    driver.drained(driver.span("deliver", t0, plan))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--cuda", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda" if args.cuda else "cpu")
    r = np.arange(64, dtype=np.int64)
    plan = StepPlan(7, r, np.zeros(64, np.int64), np.full(64, 32, np.int64), num_tokens=2048)
    driver, first, last = DriverTrace(), StageTrace(0, device), StageTrace(1, device)
    link = LocalLink()
    for _ in range(2):  # the first round warms up; the second is timed
        start = time.perf_counter()
        for _ in range(args.steps):
            one_step(driver, first, last, plan, link)
        seconds = time.perf_counter() - start
    before = sum(len(t.export().spans) for t in (driver, first, last))
    one_step(driver, first, last, plan, link)
    spans = sum(len(t.export().spans) for t in (driver, first, last)) - before
    print(
        f"{device.type}: {seconds / args.steps * 1e6:.1f} us of host work per step for "
        f"the driver, a first and a last stage together ({spans} spans per step)"
    )


if __name__ == "__main__":
    main()
