"""Light clients' latency under hostile loads (issue 57 part 7), for ``fairness.py --hostile``.

Four light clients (each its own loopback address, as separate hosts would be: the server takes
turns per client address) send a one-word ``/v1/embeddings`` request, wait ``THINK_S``, and
again. Their p99 is measured alone (quiet), then beside each hostile load, each from a client of
its own address sending again as soon as it is answered:

- big: requests of --max-inputs-per-request texts (``--heavy-words`` words each);
- chunked: one text of about --max-chunked-tokens tokens with ``long_inputs: "chunk"`` (its
  windows of max_model_len tokens run as requests of their own);
- tokenize: TEI's ``/tokenize`` with ``TOKENIZE_INPUTS`` inputs;
- all: the three at once.

Printed per load: quiet p99, loaded p99, their ratio (target <= 3), the hostile client's
answers and its throughput (tokens of answered embedding requests a second), and where the
slowest light answers' time went by the server's ``Server-Timing`` (``tail_breakdown``).

The hostile clients run in a process of their own, their bodies encoded once before they start,
as other hosts' clients would: in the light clients' process, encoding a 100,000-input body
(tens of milliseconds of its event loop, again at every refusal) and reading 2,048-vector
answers would delay the light clients' own sends and reads, and count that as the server's
latency.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import httpx
import numpy as np
from multi_model import server_timing

WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
    "wizards", "quietly", "hex",
]  # fmt: skip
LIGHT_CLIENTS = 4
THINK_S = 0.05  # a light client's pause between its requests
TOKENIZE_INPUTS = 100_000
LOADS = ("big", "chunked", "tokenize", "all")


def text(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(seed + i) % len(WORDS)] for i in range(n_words))


def client(url: str, address: str, timeout: float) -> httpx.AsyncClient:
    """A client whose connections come from ``address`` (any 127.x.y.z is this host)."""
    transport = httpx.AsyncHTTPTransport(local_address=address)
    return httpx.AsyncClient(base_url=url, timeout=timeout, transport=transport)


def p99_ms(latencies: list[float]) -> float:
    return float(np.percentile(np.array(latencies) * 1000, 99)) if latencies else float("nan")


def tail_breakdown(latencies: list[float], timings: list[dict[str, float]]) -> str:
    """Where the slowest 2% of the light answers spent their time: the medians over them of
    the client's latency, the server's ``app`` phase (and its ``engine`` and ``tokenize``
    parts, and the time in a ``replica`` process, mostly within ``engine``, where it has
    replicas) and what the app never saw (the bytes waiting for an event loop, HTTP parsing,
    the answer's way back)."""
    if not latencies:
        return "no answers"
    order = np.argsort(latencies)[-max(1, len(latencies) // 50) :]

    def median(key: str) -> float:
        return float(np.median([timings[i].get(key, 0.0) for i in order]))

    total = float(np.median([latencies[i] * 1000 for i in order]))
    app = median("app")
    over_replicas = any("replica" in t for t in timings)
    replica = f" of which replica {median('replica'):.1f}" if over_replicas else ""
    return (
        f"slowest {len(order)}: {total:.1f} ms = app {app:.1f} (engine {median('engine'):.1f}"
        f"{replica}, tokenize {median('tokenize'):.1f}) + outside the app {total - app:.1f}"
    )


async def light_clients(
    url: str, stop: asyncio.Event
) -> tuple[list[float], Counter, list[dict[str, float]]]:
    """The light clients' latencies (200s), statuses and the 200s' ``Server-Timing`` until
    ``stop``."""
    latencies: list[float] = []
    timings: list[dict[str, float]] = []
    statuses: Counter = Counter()

    async def one(k: int) -> None:
        async with client(url, f"127.0.1.{k + 1}", 120) as c:
            while not stop.is_set():
                t = time.perf_counter()
                r = await c.post("/v1/embeddings", json={"input": "hello"})
                took = time.perf_counter() - t
                statuses[r.status_code] += 1
                if r.status_code == 200:
                    latencies.append(took)
                    timings.append(server_timing(r))
                await asyncio.sleep(THINK_S)

    await asyncio.gather(*(one(k) for k in range(LIGHT_CLIENTS)))
    return latencies, statuses, timings


class Hostile:
    """One hostile client's loop: sends ``body`` to ``route`` again as soon as answered."""

    def __init__(self, name: str, route: str, body: dict, address: str) -> None:
        self.name, self.route, self.address = name, route, address
        self.payload = json.dumps(body).encode()  # once: the clock never sees the encoding
        self.statuses: Counter = Counter()

    async def run(self, url: str, stop: asyncio.Event) -> None:
        headers = {"content-type": "application/json"}
        async with client(url, self.address, 1200) as c:
            while not stop.is_set():
                r = await c.post(self.route, content=self.payload, headers=headers)
                self.statuses[r.status_code] += 1
                if r.status_code == 429:
                    await asyncio.sleep(0.05)


def _hostile_process(url: str, load: list[Hostile], go, stop, out) -> None:
    """The hostile clients' process: from ``go`` until ``stop``, then their statuses to ``out``
    (their requests in flight are dropped: the clients leave)."""

    async def main() -> None:
        done = asyncio.Event()
        tasks = [asyncio.create_task(h.run(url, done)) for h in load]
        go.set()
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        done.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    out.put([dict(h.statuses) for h in load])


def hostiles(load: str, inputs: int, words: int, chunk_words: int) -> list[Hostile]:
    big = Hostile(
        "big", "/v1/embeddings", {"input": [text(words, i) for i in range(inputs)]}, "127.0.2.1"
    )
    chunked = Hostile(
        "chunked", "/v1/embeddings",
        {"input": text(chunk_words, 0), "long_inputs": "chunk"}, "127.0.2.2",
    )  # fmt: skip
    many = [text(1 + i % 7, i) for i in range(TOKENIZE_INPUTS)]
    tokenize = Hostile("tokenize", "/tokenize", {"inputs": many}, "127.0.2.3")
    every = {"big": [big], "chunked": [chunked], "tokenize": [tokenize]}
    return [big, chunked, tokenize] if load == "all" else every[load]


async def tokens_finished(url: str) -> float:
    """The server's count of prompt tokens embedded (``/metrics``): its replicas' series where
    it has replicas (the same in every front-end process, ``--api-server-count`` above 1),
    else the engine's in its one process (a front end's own counts only what it sent)."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        text = (await c.get("/metrics")).text

    def total(name: str) -> float | None:
        values = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith((name + "{", name + " "))
        ]
        return sum(values) if values else None

    replicas = total("pipepool_replica_prompt_tokens_finished_total")
    if replicas is not None:
        return replicas
    return total("pipepool_prompt_tokens_finished_total") or 0.0


async def measure(
    url: str, seconds: float, load: list[Hostile]
) -> tuple[list[float], Counter, float, str]:
    """Light latencies over ``seconds`` beside ``load`` (started 2 s before; its clients leave
    with their requests in flight at the end). Returns (latencies, statuses, tokens a second
    the server embedded meanwhile: the hostile clients', the light ones' a few, and where the
    slowest light answers' time went: ``tail_breakdown``)."""
    ctx = mp.get_context("spawn")  # a fork would inherit the running event loop
    go, stop_hostile, out = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = None
    if load:
        proc = ctx.Process(target=_hostile_process, args=(url, load, go, stop_hostile, out))
        proc.start()
        go.wait(60)
        await asyncio.sleep(2)
    stop = asyncio.Event()
    before, t0 = await tokens_finished(url), time.perf_counter()
    light = asyncio.create_task(light_clients(url, stop))
    await asyncio.sleep(seconds)
    stop.set()
    latencies, statuses, timings = await light
    rate = (await tokens_finished(url) - before) / (time.perf_counter() - t0)
    if proc is not None:
        stop_hostile.set()
        for h, answered in zip(load, out.get(timeout=120), strict=True):
            h.statuses.update(answered)
        proc.join(60)
    await asyncio.sleep(1)  # the server drops what they left
    return latencies, statuses, rate, tail_breakdown(latencies, timings)


def run_hostile(url: str, seconds: float, loads: list[str], inputs: int, words: int,
                chunk_words: int, warmup: float = 0.0) -> None:  # fmt: skip
    """Quiet, then each load of ``loads``: one line each, then the table. ``warmup``: seconds
    of all the loads at once first, not measured (a GPU server compiles its layers in the
    background after its first steps, and runs slower until it is done)."""

    async def phase(load: list[Hostile]):
        return await measure(url, seconds, load)

    run: Callable[[list[Hostile]], Awaitable] = phase
    if warmup > 0:
        asyncio.run(measure(url, warmup, hostiles("all", inputs, words, chunk_words)))
    quiet, statuses, rate, tail = asyncio.run(run([]))
    q99 = p99_ms(quiet)
    print(
        f"quiet: {len(quiet)} light answers ({dict(statuses)}), p50 "
        f"{np.median(quiet) * 1000:.1f} ms, p99 {q99:.1f} ms; {rate:,.0f} tok/s; {tail}",
        flush=True,
    )
    rows = []
    for name in loads:
        load = hostiles(name, inputs, words, chunk_words)
        latencies, statuses, rate, tail = asyncio.run(run(load))
        l99 = p99_ms(latencies)
        answers = "; ".join(f"{h.name} {dict(h.statuses)}" for h in load)
        heavy = f"{rate:,.0f} tok/s embedded; answers {answers}"
        print(
            f"{name}: {len(latencies)} light answers ({dict(statuses)}), p50 "
            f"{np.median(latencies) * 1000:.1f} ms, p99 {l99:.1f} ms = {l99 / q99:.1f}x quiet; "
            f"{heavy}; {tail}",
            flush=True,
        )
        rows.append((name, l99, l99 / q99, heavy))
    print("\n| load | quiet p99 | loaded p99 | ratio (target <= 3) | hostile clients |")
    print("|---|---:|---:|---:|---|")
    for name, l99, ratio, heavy in rows:
        print(f"| {name} | {q99:.1f} ms | {l99:.1f} ms | {ratio:.1f}x | {heavy} |")
