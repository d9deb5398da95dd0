"""A batch's share under online load: how much of a Batch API batch a real ``pipepool serve``
(loopback) answers while --clients closed-loop online clients keep it busy.

    python benchmarks/batch_share.py                      # bundled MiniLM, CPU, 24 clients
    python benchmarks/batch_share.py --lines 2000 --seconds 300

The clients start first (each sends a short ``/v1/embeddings`` request as soon as its last
one is answered) and are measured alone for --alone seconds; then a batch of --lines lines is
uploaded and created, and --seconds later the lines answered are counted, with the online
requests' rate and latency over the same time. Target (issue 57): a 400-line batch behind 24
clients on 2 CPU cores >= 10% done in 60 s, the online requests as fast as alone.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time

import httpx
import numpy as np
from batch_latency import batch_file, sentence
from served import start_server


def online_client(url: str, k: int, stop: threading.Event, latencies: list[float]) -> None:
    with httpx.Client(base_url=url, timeout=120) as client:
        i = k
        while not stop.is_set():
            t = time.perf_counter()
            r = client.post("/v1/embeddings", json={"input": sentence(i)})
            if r.status_code != 200:
                raise SystemExit(f"online request answered {r.status_code}: {r.text[:300]}")
            latencies.append(time.perf_counter() - t)
            i += 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder (default: the bundled MiniLM)")
    p.add_argument("--lines", type=int, default=400, help="lines of the batch")
    p.add_argument("--clients", type=int, default=24, help="closed-loop online clients")
    p.add_argument("--seconds", type=float, default=60.0, help="how long the batch is given")
    p.add_argument("--alone", type=float, default=20.0, help="seconds of online load alone")
    p.add_argument("--server-arg", action="append", default=[], help="more serve flags")
    args = p.parse_args()
    state = tempfile.mkdtemp(prefix="pipepool-batch-share-")
    flags = ["--state-dir", state, "--log-level", "warning", "--no-access-log", *args.server_arg]
    if args.model:
        flags += ["--model", args.model]
    server, url = start_server(flags)
    stop = threading.Event()
    latencies: list[float] = []
    clients = [
        threading.Thread(target=online_client, args=(url, k, stop, latencies), daemon=True)
        for k in range(args.clients)
    ]
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            for t in clients:
                t.start()
            time.sleep(2.0)  # the online load is steady before it is measured
            seen, t0 = len(latencies), time.perf_counter()
            time.sleep(args.alone)
            alone = np.array(latencies[seen:]) * 1000
            took = time.perf_counter() - t0
            print(
                f"online alone ({args.clients} clients, {took:.0f} s): "
                f"{len(alone) / took:.0f} requests/s, p50 {np.median(alone):.1f} ms, "
                f"p99 {np.percentile(alone, 99):.1f} ms",
                flush=True,
            )
            upload = client.post(
                "/v1/files",
                files={"file": ("batch.jsonl", batch_file(args.lines))},
                data={"purpose": "batch"},
            ).json()
            created = time.perf_counter()
            seen = len(latencies)
            batch = client.post(
                "/v1/batches",
                json={"input_file_id": upload["id"], "endpoint": "/v1/embeddings",
                      "completion_window": "24h"},
            ).json()  # fmt: skip
            while time.perf_counter() - created < args.seconds:
                time.sleep(1.0)
                batch = client.get(f"/v1/batches/{batch['id']}").json()
                if batch["status"] not in ("validating", "in_progress", "finalizing"):
                    break
            took = time.perf_counter() - created
            during = np.array(latencies[seen:]) * 1000
            done = batch["request_counts"]["completed"] + batch["request_counts"]["failed"]
            print(
                f"batch: {done} of {args.lines} lines ({100 * done / args.lines:.1f}%) in "
                f"{took:.0f} s, status {batch['status']}, {batch['request_counts']}",
                flush=True,
            )
            print(
                f"online ({args.clients} clients) meanwhile: {len(during) / took:.0f} requests/s, "
                f"p50 {np.median(during):.1f} ms, p99 {np.percentile(during, 99):.1f} ms",
                flush=True,
            )
            print(f"target >= 10% in 60 s: {done >= 0.1 * args.lines}", flush=True)
    finally:
        stop.set()
        for t in clients:
            t.join(timeout=130)
        server.terminate()
        server.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
