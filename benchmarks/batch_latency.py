"""Online latency while the Batch API works: a short ``/v1/embeddings`` request's latency on a
real ``pipepool serve`` (loopback), idle and while a batch of --requests runs on the same
server, and the ratio.

    python benchmarks/batch_latency.py                     # the bundled MiniLM, CPU
    python benchmarks/batch_latency.py --model DIR --requests 50000

Phases, each printed as it ends:
1. idle: --probes short requests one after another (the baseline);
2. a batch of --requests lines (one short text each) is uploaded and created; once it is in
   progress with lines answered, short requests one after another until it completes (or
   --probes more of them), and the batch's own rate.

Target (issue: Batch API): online p50 during the batch within 2x of idle, the batch running
below online requests (``core.priority``) and in large steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import httpx
import numpy as np
from served import start_server

WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
    "wizards", "quietly", "hex",
]  # fmt: skip
PROBE = {"input": "hello world"}


def sentence(i: int) -> str:
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(8 + i % 17))


def batch_file(requests: int) -> bytes:
    lines = (
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/embeddings",
         "body": {"input": sentence(i)}}
        for i in range(requests)
    )  # fmt: skip
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def probe(client: httpx.Client) -> float:
    t = time.perf_counter()
    r = client.post("/v1/embeddings", json=PROBE)
    if r.status_code != 200:
        raise SystemExit(f"online request answered {r.status_code}: {r.text[:500]}")
    return time.perf_counter() - t


def summary(latencies: list[float]) -> tuple[float, float, str]:
    a = np.array(latencies) * 1000
    p50, p99 = float(np.median(a)), float(np.percentile(a, 99))
    return p50, p99, f"n={len(a)} p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {a.max():.1f} ms"


def engine_counters(client: httpx.Client) -> dict[str, float]:
    """Steps, their tokens and their time so far, from /metrics."""
    wanted = ("pipepool_steps_total", "pipepool_scheduled_tokens_total",
              "pipepool_step_time_seconds_sum")  # fmt: skip
    found = {}
    for line in client.get("/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            found[name] = float(value)
    return found


def steps_between(before: dict[str, float], after: dict[str, float]) -> str:
    steps = after["pipepool_steps_total"] - before["pipepool_steps_total"]
    if not steps:
        return "no step"
    tokens = after["pipepool_scheduled_tokens_total"] - before["pipepool_scheduled_tokens_total"]
    seconds = after["pipepool_step_time_seconds_sum"] - before["pipepool_step_time_seconds_sum"]
    each = f"{tokens / steps:.0f} tokens and {seconds / steps * 1000:.1f} ms each"
    return f"{steps:.0f} steps, {each}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder (default: the bundled MiniLM)")
    p.add_argument("--requests", type=int, default=5000, help="lines of the batch")
    p.add_argument("--probes", type=int, default=200, help="online requests per phase, at most")
    p.add_argument("--server-arg", action="append", default=[], help="more serve flags")
    args = p.parse_args()
    state = tempfile.mkdtemp(prefix="pipepool-batch-bench-")
    flags = ["--state-dir", state, "--log-level", "warning", "--no-access-log", *args.server_arg]
    if args.model:
        flags += ["--model", args.model]
    server, url = start_server(flags)
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            probe(client)  # warm-up
            before = engine_counters(client)
            idle = [probe(client) for _ in range(args.probes)]
            idle_p50, idle_p99, text = summary(idle)
            print(f"1. idle: {text}; {steps_between(before, engine_counters(client))}", flush=True)

            upload = client.post(
                "/v1/files",
                files={"file": ("batch.jsonl", batch_file(args.requests))},
                data={"purpose": "batch"},
            ).json()
            batch = client.post(
                "/v1/batches",
                json={"input_file_id": upload["id"], "endpoint": "/v1/embeddings",
                      "completion_window": "24h"},
            ).json()  # fmt: skip
            while batch["status"] in ("validating", "in_progress"):
                if batch["request_counts"]["completed"] > 0:
                    break
                time.sleep(0.05)
                batch = client.get(f"/v1/batches/{batch['id']}").json()
            started, done_at_start = time.perf_counter(), batch["request_counts"]["completed"]
            before = engine_counters(client)
            during = []
            while batch["status"] == "in_progress" and len(during) < args.probes:
                during.append(probe(client))
                batch = client.get(f"/v1/batches/{batch['id']}").json()
            steps = steps_between(before, engine_counters(client))
            while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
                time.sleep(0.1)
                batch = client.get(f"/v1/batches/{batch['id']}").json()
            took = time.perf_counter() - started
            rate = (batch["request_counts"]["completed"] - done_at_start) / took
            if not during:
                print("the batch ended before any online request was measured", file=sys.stderr)
                return 1
            p50, p99, text = summary(during)
            print(
                f"2. during a batch of {args.requests} ({batch['status']}, "
                f"{batch['request_counts']}, {rate:.0f} lines/s): {text}; {steps}",
                flush=True,
            )
            print(
                f"ratio during/idle: p50 {p50 / idle_p50:.2f}x, p99 {p99 / idle_p99:.2f}x "
                f"(target p50 <= 2x: {p50 <= 2 * idle_p50})",
                flush=True,
            )
    finally:
        server.terminate()
        server.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
