"""One server, several models (issue 35): each model's throughput served alone against the same
model served beside the others (idle), a mixed load across all of them, and a flood on one.

    python benchmarks/multi_model.py                 # CPU: bundled MiniLM, tiny cross-encoder
                                                     # and classifier (built under /tmp)
    python benchmarks/multi_model.py --gpu           # H200: MiniLM, Qwen3-0.6B and
                                                     # Qwen3-Reranker-0.6B shapes (bf16)

Real ``pipepool serve`` processes on loopback, phases printed as they end:
1. alone: each model served by a server of its own; its route at --concurrency clients for
   --requests requests (inputs/s, best of --rounds), the answers kept;
2. together: one server of all models (its memory plan in its log); each model measured as in 1
   while the others are idle, its ratio to 1 (target >= 0.9); then one small request at a time
   per model for its idle latency;
3. mixed: --mixed requests of 8 inputs spread over the models at concurrency 128: errors
   counted, and every answer to an input also sent in phase 1 checked against that answer
   (cos >= 0.99999, scores within 1e-5);
4. flood: 96 clients send 256-input requests to the last model, again as soon as answered or,
   when refused, after the 429's Retry-After-Ms or Retry-After (as the official clients do),
   then again after 20 ms; meanwhile another process sends the other models one-input requests
   one at a time: the flooded model's 429s, the others' statuses and p99 latency against their
   idle p99 (target: 429s for the flooded model only, the others' p99 within 2x).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
from served import start_server

HERE = Path(__file__).resolve().parent
WORDS = [
    "retrieval",
    "ranks",
    "documents",
    "by",
    "how",
    "well",
    "they",
    "answer",
    "a",
    "query",
    "while",
    "the",
    "embedding",
    "model",
    "maps",
    "each",
    "text",
    "to",
    "a",
    "vector",
    "whose",
    "direction",
    "carries",
    "its",
    "meaning",
    "and",
    "a",
    "reranker",
    "reads",
    "the",
    "pair",
    "together",
    "to",
    "score",
    "relevance",
    "before",
    "the",
    "classifier",
    "labels",
    "what",
    "is",
    "left",
]


# The flood: more inputs in flight than a model's queue holds (--max-queued-requests 16384).
FLOOD_CLIENTS, FLOOD_INPUTS = 96, 256
# Inputs of each mixed request (the first of a phase-1 request's, so its answers check them).
MIXED_INPUTS = 8


def text(n: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(n))


class Model:
    """A model of the benchmark: its name, folder and route, and the body of a request."""

    def __init__(self, name: str, path: Path, task: str, inputs: int, words: int) -> None:
        self.name, self.path, self.task = name, path, task
        self.inputs, self.words = inputs, words

    def body(self, seed: int, inputs: int | None = None, model: bool = True) -> tuple[str, dict]:
        n = inputs or self.inputs
        texts = [text(self.words // 2 + (seed + i) % self.words, seed + i) for i in range(n)]
        named = {"model": self.name} if model else {}
        if self.task == "embed":
            return "/v1/embeddings", {**named, "input": texts}
        if self.task == "rerank":
            return "/rerank", {**named, "query": text(8, seed), "documents": texts}
        return "/classify", {**named, "input": texts}

    def values(self, answer: dict) -> list[np.ndarray]:
        """One array per input, in input order."""
        if self.task == "embed":
            return [np.array(d["embedding"]) for d in answer["data"]]
        if self.task == "rerank":
            by_index = sorted(answer["results"], key=lambda r: r["index"])
            return [np.array([r["relevance_score"]]) for r in by_index]
        return [np.array(d["probs"]) for d in answer["data"]]


async def throughput(url: str, model: Model, requests: int, concurrency: int, keep: dict):
    """Inputs/s of ``requests`` requests at ``concurrency``; answers kept by seed."""
    queue: list[int] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def worker() -> None:
            while queue:
                seed = queue.pop()
                path, body = model.body(seed)
                r = await client.post(path, json=body)
                r.raise_for_status()
                keep[seed] = model.values(r.json())

        queue[:] = list(range(min(8, requests)))
        await asyncio.gather(*(worker() for _ in range(min(4, concurrency))))  # warm-up
        queue[:] = list(range(requests))
        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return requests * model.inputs / (time.perf_counter() - t)


async def idle_latency(url: str, model: Model, n: int) -> list[float]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for i in range(5):  # warm-up: the one-input step's shape
            path, body = model.body(10_000 + i, inputs=1)
            (await client.post(path, json=body)).raise_for_status()
        out = []
        for i in range(n):
            path, body = model.body(10_000 + i, inputs=1)
            t = time.perf_counter()
            (await client.post(path, json=body)).raise_for_status()
            out.append(time.perf_counter() - t)
        return out


def p(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values) * 1000, q)) if values else float("nan")


def stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)


async def mixed(url: str, models: list[Model], total: int, reference: dict) -> None:
    statuses: Counter = Counter()
    checked = wrong = 0
    queue = list(range(total))
    async with httpx.AsyncClient(
        base_url=url, timeout=600, limits=httpx.Limits(max_connections=128)
    ) as client:

        async def worker() -> None:
            nonlocal checked, wrong
            while queue:
                k = queue.pop()
                model = models[k % len(models)]
                seed = (k // len(models)) % 64
                path, body = model.body(seed, inputs=MIXED_INPUTS)
                r = await client.post(path, json=body)
                statuses[r.status_code] += 1
                want = reference[model.name].get(seed)
                if r.status_code == 200 and want is not None:
                    # The first inputs of the same seed's phase-1 request: the same texts.
                    for got, ref in zip(model.values(r.json()), want, strict=False):
                        checked += 1
                        wrong += not close(got, ref, model.task)

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(128)))
        took = time.perf_counter() - t
    errors = sum(n for s, n in statuses.items() if s != 200)
    print(
        f"3. mixed: {total} requests at concurrency 128 in {took:.1f} s: statuses "
        f"{dict(statuses)} ({errors} errors); {checked} answers checked against phase 1, "
        f"{wrong} wrong",
        flush=True,
    )


def close(got: np.ndarray, ref: np.ndarray, task: str) -> bool:
    if task == "embed":
        cos = float(got @ ref / (np.linalg.norm(got) * np.linalg.norm(ref)))
        return cos >= 0.99999
    return bool(np.max(np.abs(got - ref)) <= 1e-5)


async def flood(
    url: str, models: list[Model], seconds: float, idle_p99: dict, backoff: float | None
) -> None:
    """Phase 4: the heavy clients here; the light ones in a process of their own, so that
    their latencies are the server's, not this process's event loop's. ``backoff``: seconds
    a refused heavy client waits (None: the answer's Retry-After-Ms or Retry-After, as the
    official clients read them). The light clients run twice: for ``seconds`` without the
    flood (their quiet p99, the one the flood's is judged by), then during it."""
    import multiprocessing

    target, others = models[-1], models[:-1]
    flooded: Counter = Counter()

    # Each client's body, encoded once: building 256 texts and their JSON took ~4 ms a request
    # of this process's one core, which bounded how fast refused clients could come back.
    bodies = [target.body(k, inputs=FLOOD_INPUTS) for k in range(FLOOD_CLIENTS)]
    encoded = [(path, json.dumps(body).encode()) for path, body in bodies]
    json_type = {"content-type": "application/json"}

    async def heavy(k: int, ending: float) -> None:
        path, content = encoded[k]
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            while time.monotonic() < ending:
                r = await client.post(path, content=content, headers=json_type)
                flooded[r.status_code] += 1
                if r.status_code == 429:
                    wait = retry_after(r.headers) if backoff is None else backoff
                    await asyncio.sleep(wait)

    def start_lights():
        results = multiprocessing.get_context("spawn").Queue()
        lights = multiprocessing.get_context("spawn").Process(
            target=_light_process, args=(url, others, seconds, results)
        )
        lights.start()
        return lights, results

    # The same light clients first without the flood: the quiet p99 the flood is judged by.
    lights, results = start_lights()
    _, quiet_lat, _ = await asyncio.to_thread(results.get, timeout=seconds + 120)
    lights.join()
    quiet_p99 = {name: p(lat, 99) for name, lat in quiet_lat.items()}
    before = await front_end_collections(url)
    lights, results = start_lights()
    ending = time.monotonic() + seconds
    await asyncio.gather(*(heavy(k, ending) for k in range(FLOOD_CLIENTS)))
    other_status, other_lat, other_parts = results.get(timeout=120)
    lights.join()
    after = await front_end_collections(url)
    how = "Retry-After" if backoff is None else f"{backoff} s"
    print(f"4. flood on {target.name} (refused clients wait {how}): its answers {dict(flooded)}")
    print(
        "   front end's collections during the flood, by generation: "
        + ", ".join(f"{g}: {after[g] - before.get(g, 0):.0f}" for g in sorted(after)),
        flush=True,
    )
    for m in others:
        lat = other_lat[m.name]
        ratio = p(lat, 99) / idle_p99[m.name]
        quiet = quiet_p99[m.name]
        print(
            f"   {m.name}: statuses {dict(other_status[m.name])}, p50 {p(lat, 50):.1f} ms, "
            f"p99 {p(lat, 99):.1f} ms = {p(lat, 99) / quiet:.2f}x the same clients' p99 "
            f"without the flood ({quiet:.1f} ms, p50 {p(quiet_lat[m.name], 50):.1f}), "
            f"{ratio:.2f}x idle p99 ({idle_p99[m.name]:.1f} ms)",
            flush=True,
        )
        print(f"     {where_the_time_went(lat, other_parts[m.name])}", flush=True)


def retry_after(headers: httpx.Headers) -> float:
    """Seconds a refused client waits: ``retry-after-ms``, else ``retry-after``, as the
    official OpenAI client reads them."""
    if "retry-after-ms" in headers:
        return float(headers["retry-after-ms"]) / 1000
    return float(headers.get("retry-after", 1))


async def front_end_collections(url: str) -> dict[str, float]:
    """The front end's ``python_gc_collections_total`` by generation, from its /metrics."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        text = (await client.get("/metrics")).text
    prefix = 'python_gc_collections_total{generation="'
    return {
        line[len(prefix)]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix)
    }


def server_timing(response: httpx.Response) -> dict[str, float]:
    """The answer's Server-Timing phases, in ms (``pipepool.server.timing``)."""
    entries = (e.split(";dur=") for e in response.headers.get("server-timing", "").split(", "))
    return {e[0]: float(e[1]) for e in entries if len(e) == 2}


THREADED = ("tokenize", "engine", "offload")  # Server-Timing phases off the event loop


def where_the_time_went(latencies: list[float], parts: list[dict[str, float]]) -> str:
    """Each phase's p50, and its mean over the slowest 1% of requests (``latencies`` in s,
    ``parts`` in ms): ``outside`` is the client's latency less the app's (the request's bytes
    waiting for the front end's event loop, HTTP parsing, the client's own loop); ``loop`` the
    app's less its phases on threads and in the engine (the body read, checked and parsed, the
    answer built)."""
    rows = [
        {
            **d,
            "outside": lat * 1000 - d.get("app", 0.0),
            "loop": d.get("app", 0.0) - sum(d.get(n, 0.0) for n in THREADED),
            "client": lat * 1000,
        }
        for lat, d in zip(latencies, parts, strict=True)
    ]
    if not rows:
        return "no answers"
    slow = sorted(rows, key=lambda r: r["client"])[-max(1, len(rows) // 100) :]
    names = ("client", "outside", "app", "loop", "lane", "tokenize", "engine", "offload")
    p50s = " ".join(f"{n} {np.median([r.get(n, 0.0) for r in rows]):.1f}" for n in names)
    tails = " ".join(f"{n} {np.mean([r.get(n, 0.0) for r in slow]):.1f}" for n in names)
    return f"ms, p50: {p50s}; the slowest 1% ({len(slow)}), mean: {tails}"


def _light_process(url: str, models: list[Model], seconds: float, results) -> None:
    """One-input requests to each of ``models``, one at a time each, for ``seconds``; puts
    (statuses, latencies, Server-Timing phases) by model on ``results``."""
    statuses = {m.name: Counter() for m in models}
    latencies: dict[str, list[float]] = {m.name: [] for m in models}
    parts: dict[str, list[dict[str, float]]] = {m.name: [] for m in models}
    ending = time.monotonic() + seconds

    async def light(model: Model) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            i = 0
            while time.monotonic() < ending:
                path, body = model.body(20_000 + i, inputs=1)
                t = time.perf_counter()
                r = await client.post(path, json=body)
                statuses[model.name][r.status_code] += 1
                if r.status_code == 200:
                    latencies[model.name].append(time.perf_counter() - t)
                    parts[model.name].append(server_timing(r))
                i += 1
                await asyncio.sleep(0.02)

    async def all_of_them() -> None:
        await asyncio.gather(*(light(m) for m in models))

    asyncio.run(all_of_them())
    results.put((statuses, latencies, parts))


def cpu_models() -> list[Model]:
    sys.path.insert(0, str(HERE.parent / "tests"))
    import tiny_models

    root = Path("/tmp/pipepool-bench/multi")
    ce = root / "cross-encoder"
    if not (ce / "config.json").exists():
        tiny_models.make_cross_encoder(ce)
    clf = root / "classifier"
    if not (clf / "config.json").exists():
        tiny_models.make_decoder_classifier(clf, "qwen3")
    return [
        Model("embedder", tiny_models.minilm_path(), "embed", 8, 40),
        Model("reranker", ce, "rerank", 8, 60),
        Model("classifier", clf, "classify", 8, 40),
    ]


def gpu_models() -> list[Model]:
    import torch

    sys.path.insert(0, str(HERE))
    import gpu_suite
    import rerank

    words = rerank.vocabulary_words()
    reranker = rerank.build_shape("qwen3-reranker-0.6b", torch.bfloat16, words, None)
    return [
        Model("minilm", gpu_suite.build_checkpoint("minilm"), "embed", 256, 40),
        Model("qwen3-0.6b", gpu_suite.build_checkpoint("0.6b"), "embed", 64, 200),
        Model("qwen3-reranker", reranker, "rerank", 64, 150),
    ]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--mixed", type=int, default=5000)
    parser.add_argument("--flood-seconds", type=float, default=20.0)
    parser.add_argument(
        "--only-flood", action="store_true", help="phases 2 (idle latency) and 4 only"
    )
    parser.add_argument(
        "--floods", type=int, default=2, help="1: the Retry-After flood only; 2: the 20 ms one too"
    )
    parser.add_argument(
        "--flood-rounds", type=int, default=1, help="each flood this many times, one server"
    )
    parser.add_argument("--extra", default="", help="more flags for every server, space-separated")
    args = parser.parse_args()
    models = gpu_models() if args.gpu else cpu_models()
    requests = args.requests or (200 if args.gpu else 48)
    device = ["--device", "cuda" if args.gpu else "cpu"]
    limits = ["--max-inputs-per-request", "256", "--max-queued-requests", "16384"]
    limits += ["--no-access-log", *args.extra.split()]

    alone: dict[str, float] = {m.name: float("nan") for m in models}
    reference: dict[str, dict] = {}
    for m in [] if args.only_flood else models:
        proc, url = start_server(["--model", f"{m.name}={m.path}", *device, *limits])
        try:
            keep: dict = {}
            rates = [
                await throughput(url, m, requests, args.concurrency, keep)
                for _ in range(args.rounds)
            ]
            alone[m.name], reference[m.name] = max(rates), keep
        finally:
            stop(proc)
        print(f"1. alone: {m.name} ({m.task}) {alone[m.name]:.0f} inputs/s", flush=True)

    flags = [a for m in models for a in ("--model", f"{m.name}={m.path}")]
    proc, url = start_server([*flags, *device, *limits])
    try:
        idle_p99 = {}
        for m in models:
            rounds = 0 if args.only_flood else args.rounds
            rates = [
                await throughput(url, m, requests, args.concurrency, {}) for _ in range(rounds)
            ]
            best = max(rates, default=float("nan"))
            lat = await idle_latency(url, m, 200)
            idle_p99[m.name] = p(lat, 99)
            print(
                f"2. together, the others idle: {m.name} {best:.0f} inputs/s = "
                f"{best / alone[m.name]:.3f}x alone; idle one-input p50 {p(lat, 50):.1f} ms, "
                f"p99 {p(lat, 99):.1f} ms",
                flush=True,
            )
        if not args.only_flood:
            await mixed(url, models, args.mixed, reference)
        for backoff in (None, 0.02)[: args.floods]:
            for _ in range(args.flood_rounds):
                await flood(url, models, args.flood_seconds, idle_p99, backoff)
    finally:
        stop(proc)


if __name__ == "__main__":
    asyncio.run(main())
