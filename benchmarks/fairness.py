"""No client can starve the others: a one-word request's latency on a real ``pipepool serve``
(loopback) while heavy clients load it, against the same request on the idle server.

    python benchmarks/fairness.py                       # the bundled MiniLM, CPU
    python benchmarks/fairness.py --model DIR --heavy-seconds 60

Three phases, each printed as it ends:
1. idle: one-word requests one after another (the baseline);
2. one maximal request (--max-inputs-per-request inputs whose tokens add up to about
   --max-tokens-per-request) and one-word requests every --probe-interval while it runs;
3. eight clients that keep the queue at its limit (each sends --max-inputs-per-request short
   texts, again as soon as one is answered or refused) and four clients of one-word requests
   meanwhile: their statuses (429s counted) and latencies; then the eight disconnect with
   their requests in flight, and one-word requests measure how soon the server is free.

Targets (issue 37): phase 2's one-word latency within 2 s; phase 3's one-word clients served
(no 429 storm); after the disconnect, a one-word request answered within 1 s.

    python benchmarks/fairness.py --hostile [big chunked tokenize all] [--seconds 20]

instead runs issue 57's loads (``fairness_hostile.py``): four light clients alone, then beside
each hostile load; per load the light clients' quiet p99, loaded p99 and their ratio (target
within 3x on the CPU), and the tokens a second the server embedded meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter

import httpx
import numpy as np
from fairness_hostile import LOADS, run_hostile
from served import start_server

WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
    "wizards", "quietly", "hex",
]  # fmt: skip
ONE_WORD = {"input": "hello"}


def text(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(seed + i) % len(WORDS)] for i in range(n_words))


async def one_word(client: httpx.AsyncClient) -> tuple[int, float]:
    t = time.perf_counter()
    r = await client.post("/v1/embeddings", json=ONE_WORD)
    return r.status_code, time.perf_counter() - t


def summary(latencies: list[float]) -> str:
    if not latencies:
        return "none answered"
    a = np.array(latencies) * 1000
    return (
        f"n={len(a)} p50 {np.median(a):.1f} ms, p99 {np.percentile(a, 99):.1f} ms, "
        f"max {a.max():.1f} ms"
    )


async def phase_idle(url: str, n: int) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        await one_word(client)  # warm-up
        latencies = [(await one_word(client))[1] for _ in range(n)]
    print(f"1. idle one-word: {summary(latencies)}", flush=True)
    return float(np.median(latencies))


async def phase_maximal(url: str, inputs: int, words: int, interval: float) -> list[float]:
    body = {"input": [text(words, i) for i in range(inputs)]}
    async with (
        httpx.AsyncClient(base_url=url, timeout=1200) as big,
        httpx.AsyncClient(base_url=url, timeout=60) as probe,
    ):
        t = time.perf_counter()
        task = asyncio.create_task(big.post("/v1/embeddings", json=body))
        latencies, statuses = [], Counter()
        while not task.done():
            status, seconds = await one_word(probe)
            statuses[status] += 1
            latencies.append(seconds)
            await asyncio.sleep(interval)
        r = await task
        took = time.perf_counter() - t
    tokens = r.json()["usage"]["prompt_tokens"] if r.status_code == 200 else r.text[:200]
    print(
        f"2. maximal request ({inputs} inputs, {tokens} tokens, status {r.status_code}, "
        f"{took:.1f} s); one-word meanwhile: {summary(latencies)}; statuses {dict(statuses)}",
        flush=True,
    )
    return latencies


async def phase_flood(url: str, inputs: int, seconds: float) -> tuple[list[float], Counter, float]:
    heavy_statuses: Counter = Counter()

    async def heavy(k: int) -> None:
        body = {"input": [text(5 + (i + k) % 15, i + k) for i in range(inputs)]}
        async with httpx.AsyncClient(base_url=url, timeout=1200) as client:
            while True:
                r = await client.post("/v1/embeddings", json=body)
                heavy_statuses[r.status_code] += 1
                if r.status_code == 429:
                    await asyncio.sleep(0.05)

    light_latencies: list[float] = []
    light_statuses: Counter = Counter()

    async def light() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            while True:
                status, took = await one_word(client)
                light_statuses[status] += 1
                if status == 200:
                    light_latencies.append(took)
                await asyncio.sleep(0.1)

    heavies = [asyncio.create_task(heavy(k)) for k in range(8)]
    await asyncio.sleep(2)  # the queue fills
    lights = [asyncio.create_task(light()) for _ in range(4)]
    await asyncio.sleep(seconds)
    for task in lights:
        task.cancel()
    print(
        f"3. eight heavy clients ({inputs} inputs a request; answers {dict(heavy_statuses)}); "
        f"one-word clients: statuses {dict(light_statuses)}, {summary(light_latencies)}",
        flush=True,
    )
    for task in heavies:  # disconnect with requests in flight
        task.cancel()
    await asyncio.gather(*heavies, *lights, return_exceptions=True)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        status, first = await one_word(client)
        after = [first] + [(await one_word(client))[1] for _ in range(9)]
    print(
        f"   after they disconnected: first one-word {first * 1000:.1f} ms (status {status}); "
        f"{summary(after)}",
        flush=True,
    )
    return light_latencies, light_statuses, first


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder (default: the bundled MiniLM)")
    p.add_argument("--max-inputs-per-request", type=int, default=2048)
    p.add_argument("--max-tokens-per-request", type=int, default=300_000)
    p.add_argument("--probe-interval", type=float, default=0.25)
    p.add_argument("--heavy-seconds", type=float, default=30.0)
    p.add_argument("--server-arg", action="append", default=[], help="more serve flags")
    p.add_argument(
        "--hostile", nargs="*", choices=LOADS, default=None,
        help="issue 57's loads instead of the phases above (none named: all of them); "
        "fairness_hostile.py says what each is",
    )  # fmt: skip
    p.add_argument("--seconds", type=float, default=20.0, help="--hostile: light seconds a load")
    p.add_argument("--heavy-words", type=int, default=130, help="--hostile: words a big text")
    p.add_argument(
        "--warmup", type=float, default=0.0,
        help="--hostile: seconds of all the loads at once before the quiet phase, not measured "
        "(on a GPU, until the background compile is done)",
    )  # fmt: skip
    args = p.parse_args()
    flags = ["--log-level", "warning", "--no-access-log"]
    if args.model:
        flags += ["--model", args.model]
    flags += ["--max-inputs-per-request", str(args.max_inputs_per_request)]
    flags += ["--max-tokens-per-request", str(args.max_tokens_per_request)]
    server, url = start_server(flags + args.server_arg)
    if args.hostile is not None:
        try:
            # Words of the chunked text: within the default --max-chunked-tokens (32,768).
            run_hostile(url, args.seconds, args.hostile or list(LOADS),
                        args.max_inputs_per_request, args.heavy_words, 28_000,
                        args.warmup)  # fmt: skip
        finally:
            server.terminate()
            server.wait(60)
        return 0
    try:
        idle = asyncio.run(phase_idle(url, 30))
        # Words of a maximal request's texts: their tokens add up to 95% of the request limit.
        per_text = 0.95 * args.max_tokens_per_request / args.max_inputs_per_request
        probe = httpx.post(url + "/tokenize", json={"prompt": text(100, 0)}, timeout=60).json()
        words = max(1, int(100 * per_text / probe["count"]))
        during = asyncio.run(
            phase_maximal(url, args.max_inputs_per_request, words, args.probe_interval)
        )
        _, light_statuses, first_after = asyncio.run(
            phase_flood(url, args.max_inputs_per_request, args.heavy_seconds)
        )
        refused = light_statuses.get(429, 0) / max(1, sum(light_statuses.values()))
        print(
            f"targets: one-word during the maximal request p50 {np.median(during):.3f} s, max "
            f"{max(during):.3f} s (<= 2 s: {max(during) <= 2}); idle p50 {idle * 1000:.1f} ms; "
            f"one-word 429s under the flood {refused:.1%} (no storm: {refused == 0}); first "
            f"one-word after the disconnect {first_after:.3f} s (<= 1 s: {first_after <= 1})",
            flush=True,
        )
    finally:
        server.terminate()
        server.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
