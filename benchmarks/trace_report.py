"""What a pipeline's step timeline says: per stage and span, how long and how often, and
how the compute of one step changes over a run.

    python benchmarks/trace_report.py results/pp1.json results/pp2.json [--suite suite.json]

For each trace file (``--trace`` of ``pipepool bench``/``embed``/``serve``): per process and
span name the count, total, median and 90th percentile; per stage the compute rate
(forward ms per 1,000 tokens) of the first step, the middle steps and the last steps — in
the fill the first stage computes alone and in the drain the last stage does, so a rate that
differs there from the middle says the stages slow each other down (transfers beside
compute) rather than that one of them has more to do. With ``--suite`` (gpu_suite's
suite.json), also PP=2 / PP=1 and the cost of tracing (rows traced vs not, same shape).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def load(path: Path) -> tuple[dict[int, str], list[dict]]:
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    return names, [e for e in events if e["ph"] == "X"]


def span_table(names: dict[int, str], spans: list[dict]) -> list[str]:
    durations: dict[tuple[str, str], list[float]] = defaultdict(list)
    for e in spans:
        durations[(names[e["pid"]], e["name"])].append(e["dur"] / 1e3)
    lines = [f"{'process':<9} {'span':<13} {'count':>6} {'total ms':>10} {'median':>9} {'p90':>9}"]
    for (process, name), ms in sorted(durations.items()):
        ms.sort()
        p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
        lines.append(
            f"{process:<9} {name:<13} {len(ms):6d} {sum(ms):10.1f} "
            f"{statistics.median(ms):9.3f} {p90:9.3f}"
        )
    return lines


def compute_rates(names: dict[int, str], spans: list[dict]) -> list[str]:
    """Forward ms per 1,000 tokens per stage: first step, middle steps, last steps."""
    lines = []
    by_stage: dict[str, list[dict]] = defaultdict(list)
    for e in spans:
        if e["name"] == "forward" and "args" in e and e["args"]["tokens"]:
            by_stage[names[e["pid"]]].append(e)
    for stage, events in sorted(by_stage.items()):
        events.sort(key=lambda e: e["ts"])
        rates = [e["dur"] / e["args"]["tokens"] for e in events]  # us per token = ms per 1k
        n = len(rates)
        middle = rates[n // 4 : max(n // 4 + 1, 3 * n // 4)]
        lines.append(
            f"{stage:<9} forward ms per 1k tokens: first {rates[0]:.3f}, middle median "
            f"{statistics.median(middle):.3f}, last {rates[-1]:.3f} ({n} steps, "
            f"{sum(e['args']['tokens'] for e in events)} tokens)"
        )
    return lines


def transfer_overlap(names: dict[int, str], spans: list[dict]) -> list[str]:
    """CUDA: how much of each stage's compute ran beside one of its NCCL transfers (a send
    waiting for the next stage to take it spins on the GPU for that long)."""
    lines = []
    for pid, stage in sorted(names.items()):
        forward = _merge([(e["ts"], e["ts"] + e["dur"]) for e in spans
                          if e["pid"] == pid and e["name"] == "forward"])  # fmt: skip
        transfers = _merge([(e["ts"], e["ts"] + e["dur"]) for e in spans
                            if e["pid"] == pid and e["name"].startswith("nccl ")])  # fmt: skip
        if not forward or not transfers:
            continue
        both = _overlap(forward, transfers)
        total = sum(b - a for a, b in forward)
        moving = sum(d - c for c, d in transfers)
        lines.append(
            f"{stage:<9} compute beside an NCCL transfer: {both / 1e3:.1f} of {total / 1e3:.1f}"
            f" ms ({100 * both / total:.1f}%); transfers in flight {moving / 1e3:.1f} ms"
        )
    return lines


def _overlap(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        total += max(0.0, min(x[i][1], y[j][1]) - max(x[i][0], y[j][0]))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def suite_lines(rows: list[dict]) -> list[str]:
    lines = []
    traced = {(r["stages"], bool(r.get("trace"))): r for r in rows}
    for (stages, on), r in sorted(traced.items()):
        lines.append(
            f"PP={stages} trace {'on ' if on else 'off'}: {r['engine_tokens_per_s']:,} tok/s, "
            f"of peak {r['engine_fraction_of_peak']}, steps {r['engine_steps']}, "
            f"idle (busy clock) {r['stage_idle_fraction']}"
        )
    one, two = traced.get((1, True)) or traced.get((1, False)), traced.get((2, False))
    two_on = traced.get((2, True))
    if one and (two or two_on):
        best = two or two_on
        lines.append(
            f"PP=2 / PP=1: {best['engine_tokens_per_s'] / one['engine_tokens_per_s']:.3f}x"
        )
    if two and two_on:
        cost = 1 - two_on["engine_tokens_per_s"] / two["engine_tokens_per_s"]
        lines.append(f"tracing cost at PP=2 (on vs off, same shape): {100 * cost:+.2f}%")
    if one and one.get("trace") and two_on and two_on.get("trace"):
        pp1 = one["trace"]["stages"][0]["busy_ms_per_step"]
        pp2 = [s["busy_ms_per_step"] for s in two_on["trace"]["stages"]]
        lines.append(
            f"busy ms per step: PP=1 {pp1:.2f}; PP=2 stages {', '.join(f'{x:.2f}' for x in pp2)}"
            f" (sum {sum(pp2):.2f} = {sum(pp2) / pp1:.3f} x PP=1: above 1, the same work"
            " takes longer split in two)"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("traces", nargs="*", type=Path)
    parser.add_argument(
        "--suite", type=Path, action="append", default=[], help="gpu_suite.py's suite.json"
    )
    args = parser.parse_args()
    rows = [row for path in args.suite if path.exists() for row in json.loads(path.read_text())]
    if rows:
        print("\n".join(suite_lines(rows)))
    for path in (p for p in args.traces if p.exists()):
        names, spans = load(path)
        print(f"\n== {path} ({path.stat().st_size / 2**20:.1f} MiB, {len(spans)} spans)")
        print("\n".join(span_table(names, spans)))
        print("\n".join(compute_rates(names, spans)))
        print("\n".join(transfer_overlap(names, spans)))


if __name__ == "__main__":
    main()
