"""Served throughput of ``pipepool serve`` against offline ``Engine.embed``, same workload, same
machine, same run.

    python benchmarks/bench_server.py --concurrency 32 --requests 512

Starts a real server process, sends ``--requests`` embedding requests from ``--concurrency``
concurrent clients (httpx.AsyncClient, base64 like the official openai client), then embeds
the same inputs offline with one in-process Engine, and prints both and their ratio. The
server and the offline engine never run at the same time. Default model: the bundled
all-MiniLM-L6-v2; works on CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import random
import signal
import sys
import time

import httpx
import numpy as np
from served import start_server

import pipepool

_VOCABULARY = (
    "the a pipeline stage model token chunk prefill cache vector embedding server client "
    "request batch step scheduler queue block memory layer attention pooling result fast slow "
    "long short river mountain city music history science language data system network"
)
WORDS = _VOCABULARY.split()


def workload(num_requests: int, per_request: int, seed: int) -> list[list[str]]:
    """Texts of mixed lengths (4 to 200 words, most of them short, like real traffic)."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        texts = []
        for _ in range(per_request):
            n = min(200, 4 + int(rng.expovariate(1 / 30)))
            texts.append(" ".join(rng.choice(WORDS) for _ in range(n)))
        requests.append(texts)
    return requests


async def drive(url: str, requests: list[list[str]], concurrency: int, fmt: str) -> tuple:
    """Send every request, at most ``concurrency`` at a time; (seconds, tokens, vectors)."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(requests)):
        queue.put_nowait(i)
    vectors: list = [None] * len(requests)
    tokens = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while not queue.empty():
            i = queue.get_nowait()
            body = {"input": requests[i], "encoding_format": fmt}
            r = await http.post(url + "/v1/embeddings", json=body)
            r.raise_for_status()
            data = r.json()
            tokens += data["usage"]["prompt_tokens"]
            vectors[i] = [_decode(d["embedding"]) for d in data["data"]]

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return seconds, tokens, vectors


def _decode(embedding) -> np.ndarray:
    if isinstance(embedding, str):
        return np.frombuffer(base64.b64decode(embedding), dtype="<f4")
    return np.asarray(embedding, dtype=np.float32)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: bundled all-MiniLM-L6-v2)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--inputs-per-request", type=int, default=1)
    p.add_argument("--encoding-format", choices=["base64", "float"], default="base64")
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    requests = workload(args.requests, args.inputs_per_request, args.seed)
    flat = [t for r in requests for t in r]
    engine_flags = ["--pp", str(args.pp), "--device", args.device]
    engine_flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.model:
        engine_flags += ["--model", args.model]

    proc, url = start_server(["--no-access-log", "--log-level", "warning", *engine_flags])
    try:
        asyncio.run(drive(url, requests[: args.concurrency], args.concurrency, "base64"))  # warm
        served_s, tokens, served = asyncio.run(
            drive(url, requests, args.concurrency, args.encoding_format)
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)

    with pipepool.Engine(
        args.model,
        pipeline_parallel_size=args.pp,
        max_num_batched_tokens=args.max_num_batched_tokens,
        device=args.device,
    ) as engine:
        engine.embed(flat[: args.concurrency])  # warm
        start = time.perf_counter()
        offline = engine.embed(flat)
        offline_s = time.perf_counter() - start
        d = engine.pipeline.deployment

    served_flat = np.stack([v for r in served for v in r])
    worst = _worst_cosine(served_flat, offline)

    n_req, n_in = len(requests), len(flat)
    print(
        f"model {args.model or 'all-MiniLM-L6-v2 (bundled)'}, {d.devices[0]}, "
        f"pp={args.pp}, max_num_batched_tokens={args.max_num_batched_tokens}, "
        f"{os.cpu_count()} CPU cores"
    )
    print(
        f"workload: {n_req} requests x {args.inputs_per_request} input(s), {tokens} tokens "
        f"({tokens / n_in:.1f} per input), concurrency {args.concurrency}, "
        f"{args.encoding_format} responses"
    )
    print(f"{'':10}{'seconds':>10}{'requests/s':>13}{'inputs/s':>11}{'tokens/s':>12}")
    for label, secs in (("served", served_s), ("offline", offline_s)):
        print(f"{label:10}{secs:10.2f}{n_req / secs:13.1f}{n_in / secs:11.1f}{tokens / secs:12.0f}")
    print(f"served / offline throughput: {offline_s / served_s:.2f}")
    print(f"worst cosine served vs offline: {worst:.7f}")
    return 0


def _worst_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


if __name__ == "__main__":
    sys.exit(main())
