"""Where each stage's time went, from a gathered trace.

The window is the time in which plans were in flight (the driver's "in flight" periods, cut to
what the caller asks for). For every stage and every period, the time before the stage's first
compute is **fill** and the time after its last compute is **drain** (the pipeline bubble);
in between, each instant counts once, in this order: **busy** (the device computes or pools),
**wait_send** (the device, or on CPU the stage, waits for its previous send to complete),
**wait_input** (it waits for the previous stage's hidden states or digest, or for the plan),
and **host** (none of these: the device waits for its own host, or the driver's). The six
fractions add up to 1. A window's edges count as the edges of the periods they cut.

Stage 0 runs in the driver's loop: its plan waits while the driver waits for a result (it
holds a plan back until one frees a place in the pipeline), so the driver's "wait result"
spans are stage 0's waits for input, as "wait plan" is for a stage process.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .intervals import Intervals, intersect, length, subtract, union
from .recorder import ProcessTrace

BUSY = frozenset({"forward", "pool"})
WAIT_SEND = frozenset({"wait send"})
WAIT_INPUT = frozenset({"wait input", "wait plan", "wait digest"})
DRIVER_SPANS = ("schedule", "submit", "wait result", "deliver")


@dataclass(frozen=True)
class StageTime:
    """Where one stage's time went within a trace window, as shares of the window: computing
    (busy), waiting for its input or to send, host work, pipeline fill and drain."""

    stage: str
    busy: float
    wait_input: float
    wait_send: float
    host: float
    fill: float
    drain: float
    steps: int
    busy_ms_per_step: float

    @property
    def bubble(self) -> float:
        return self.fill + self.drain


@dataclass(frozen=True)
class TraceSummary:
    """A trace window in numbers: how long plans were in flight, each stage's ``StageTime``
    and the driver loop's shares; printable (``text``) and JSON-ready (``as_dict``)."""

    seconds: float  # plans in flight, within the window
    periods: int  # busy periods (from the first plan in flight to none in flight)
    stages: tuple[StageTime, ...]
    driver: dict[str, float]  # share of the window in each of the loop's spans

    def as_dict(self) -> dict:
        stages = []
        for s in self.stages:
            row = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(s).items()}
            row["bubble"] = round(s.bubble, 4)
            stages.append(row)
        return {
            "seconds": round(self.seconds, 4),
            "periods": self.periods,
            "stages": stages,
            "driver": {k: round(v, 4) for k, v in self.driver.items()},
        }

    def text(self) -> str:
        steps = max((s.steps for s in self.stages), default=0)
        lines = [
            f"pipeline timeline: {len(self.stages)} stage(s), {steps} steps, "
            f"{self.seconds:.3f} s with plans in flight ({self.periods} period(s))",
            "stage     busy  wait-input  wait-send   host   fill  drain   steps  busy ms/step",
        ]
        for s in self.stages:
            lines.append(
                f"{s.stage:<8} {s.busy:5.3f}  {s.wait_input:10.3f}  {s.wait_send:9.3f}  "
                f"{s.host:5.3f}  {s.fill:5.3f}  {s.drain:5.3f}  {s.steps:6d}  "
                f"{s.busy_ms_per_step:12.2f}"
            )
        bubble = ", ".join(f"{s.stage} {s.bubble:.3f}" for s in self.stages)
        lines.append(f"bubble (fill + drain): {bubble}")
        lines.append("driver: " + ", ".join(f"{k} {v:.3f}" for k, v in self.driver.items()))
        return "\n".join(lines)


def summarize(
    traces: list[ProcessTrace], since_ns: int | None = None, until_ns: int | None = None
) -> TraceSummary:
    """The summary of gathered traces (times on the driver's clock) within [since, until]."""
    driver = next((t for t in traces if t.name == "driver"), None)
    periods = []
    if driver is not None:
        periods = union((s.start_ns, s.end_ns) for s in driver.spans if s.track == "pipeline")
    lo = since_ns if since_ns is not None else -(2**63)
    hi = until_ns if until_ns is not None else 2**63
    periods = intersect(periods, [(lo, hi)])
    total = length(periods)
    holding = [] if driver is None else [s for s in driver.spans if s.name == "wait result"]
    stages = tuple(
        _stage_time(t, periods, total, holding if t.sort == 1 else [])
        for t in sorted(traces, key=lambda t: t.sort)
        if t.name != "driver"
    )
    loop = {}
    if driver is not None:
        for name in DRIVER_SPANS:
            spans = union((s.start_ns, s.end_ns) for s in driver.spans if s.name == name)
            loop[name] = length(intersect(spans, periods)) / total if total else 0.0
    return TraceSummary(total / 1e9, len(periods), stages, loop)


def _stage_time(trace: ProcessTrace, periods: Intervals, total: int, plan_waits: list) -> StageTime:
    """``plan_waits``: spans (on the driver's clock) in which the stage's next plan waited."""
    off = trace.offset_ns

    def spans_of(names: frozenset) -> Intervals:
        mine = [(s.start_ns + off, s.end_ns + off) for s in trace.spans if s.name in names]
        if names is WAIT_INPUT:
            mine += [(s.start_ns, s.end_ns) for s in plan_waits]
        return union(mine)

    busy = intersect(spans_of(BUSY), periods)
    inner: Intervals = []  # from the first to the last compute of every period
    bubble_fill = bubble_drain = 0
    for p0, p1 in periods:
        mine = intersect(busy, [(p0, p1)])
        if not mine:
            bubble_fill += p1 - p0  # nothing computed: the whole period waited for work
            continue
        inner.append((mine[0][0], mine[-1][1]))
        bubble_fill += mine[0][0] - p0
        bubble_drain += p1 - mine[-1][1]
    wait_send = subtract(intersect(spans_of(WAIT_SEND), inner), busy)
    wait_input = subtract(subtract(intersect(spans_of(WAIT_INPUT), inner), busy), wait_send)
    host = length(inner) - length(busy) - length(wait_send) - length(wait_input)
    steps = len({s.step for s in trace.spans if s.name == "forward"
                 and intersect([(s.start_ns + off, s.end_ns + off)], periods)})  # fmt: skip

    def share(ns: int) -> float:
        return ns / total if total else 0.0

    return StageTime(
        stage=trace.name,
        busy=share(length(busy)),
        wait_input=share(length(wait_input)),
        wait_send=share(length(wait_send)),
        host=share(host),
        fill=share(bubble_fill),
        drain=share(bubble_drain),
        steps=steps,
        busy_ms_per_step=length(busy) / steps / 1e6 if steps else 0.0,
    )


def summarize_pipelines(
    per_pipeline: list[list[ProcessTrace]], since_ns: int | None = None, until_ns: int | None = None
) -> tuple[TraceSummary, list[ProcessTrace]]:
    """The summary of one or more pipelines' traces (replicas: one list each) and the traces
    to write. Several pipelines: each is summed up on its own (its own periods), their stages
    listed as "rK stage N", the driver shares averaged, and each process named after its
    replica in the file."""
    if len(per_pipeline) == 1:
        return summarize(per_pipeline[0], since_ns, until_ns), per_pipeline[0]
    summaries = [summarize(traces, since_ns, until_ns) for traces in per_pipeline]
    stages = tuple(
        replace(stage, stage=f"r{r} {stage.stage}")
        for r, summary in enumerate(summaries)
        for stage in summary.stages
    )
    names = summaries[0].driver.keys() if summaries else ()
    driver = {k: sum(s.driver.get(k, 0.0) for s in summaries) / len(summaries) for k in names}
    merged = TraceSummary(
        max((s.seconds for s in summaries), default=0.0),
        sum(s.periods for s in summaries),
        stages,
        driver,
    )
    traces = [
        replace(trace, name=f"replica {r} {trace.name}", sort=r * 1000 + trace.sort)
        for r, pipeline in enumerate(per_pipeline)
        for trace in pipeline
    ]
    return merged, traces
