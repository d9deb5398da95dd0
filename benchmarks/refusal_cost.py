"""What one refused request costs the server's front end (issue 35's hostile flood).

    python benchmarks/refusal_cost.py [--requests 400] [--clients 8] [--api-server-count 1]

A real ``pipepool serve`` of the CPU models of ``multi_model.py`` (each model in its own replica
process, so the front end does HTTP only), with ``--max-inputs-per-request`` one below the
flood's 256 rerank documents: every such request is turned away (400) after its body is read,
parsed and validated, where a full queue's 429 is raised (``routes/scoring``: the input count
is checked just before the queue). Prints the front-end processes' CPU time per refusal (from
``/proc/PID/stat``, read before and after) and the wall time per refusal, then the same for
one-input embedding requests that are answered, as the scale.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections import Counter

import httpx
from multi_model import FLOOD_INPUTS, cpu_models
from served import start_server

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` so far."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / _TICKS


def front_ends(server_pid: int, count: int) -> list[int]:
    """The server's process and, with more front ends, its API server children (the
    processes running ``pipepool.server.api_worker``)."""
    pids = [server_pid]
    if count > 1:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read()
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            if parent == server_pid and b"api_worker" in cmd:
                pids.append(int(entry))
    return pids


async def send(url: str, bodies: list[tuple[str, dict]], clients: int) -> tuple[Counter, float]:
    statuses: Counter = Counter()
    queue = list(bodies)

    async def client() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            while queue:
                path, body = queue.pop()
                statuses[(await c.post(path, json=body)).status_code] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return statuses, time.perf_counter() - t0


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--api-server-count", type=int, default=1)
    args = parser.parse_args()
    models = cpu_models()
    flags = [a for m in models for a in ("--model", f"{m.name}={m.path}")]
    flags += ["--device", "cpu", "--no-access-log"]
    flags += ["--max-inputs-per-request", str(FLOOD_INPUTS - 1)]
    flags += ["--api-server-count", str(args.api_server_count)]
    proc, url = start_server(flags)
    try:
        pids = front_ends(proc.pid, args.api_server_count)
        embedder, reranker = models[0], models[1]
        floods = [reranker.body(k, inputs=FLOOD_INPUTS) for k in range(args.requests)]
        size = sum(len(httpx.Request("POST", url, json=b).content) for _, b in floods[:8]) / 8
        singles = [embedder.body(k, inputs=1) for k in range(args.requests)]
        await send(url, floods[:32] + singles[:32], args.clients)  # warm-up
        runs = (("refused rerank (256 documents)", floods), ("answered embed (1 input)", singles))
        for name, bodies in runs:
            before = cpu_seconds(pids)
            statuses, wall = await send(url, bodies, args.clients)
            used = cpu_seconds(pids) - before
            n = len(bodies)
            print(
                f"{name}: {dict(statuses)}; front end CPU {used / n * 1e3:.2f} ms a request, "
                f"wall {wall / n * 1e3:.2f} ms a request at {args.clients} clients"
                + (f" (bodies ~{size / 1024:.0f} KB)" if bodies is floods else ""),
                flush=True,
            )
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    asyncio.run(main())
