"""Served throughput of ``pipepool serve`` with data-parallel replicas against one replica, same
workload, same machine, same run (issue 14).

    python benchmarks/dp_server.py --model /tmp/pipepool-bench/0.6b-shape --workload W1 \
        --variant 'dp1||' --variant 'dp2||--dp 2'

Each ``--variant NAME|ENV|FLAGS`` starts a server (``ENV``: space-separated VAR=value for the
server process, e.g. ``CUDA_VISIBLE_DEVICES=0``; ``FLAGS``: extra ``pipepool serve`` flags),
sends one warm-up pass of the workload (compilation, CUDA graphs of every step size), then
``--passes`` timed passes from ``--clients`` client processes with ``--concurrency`` requests in
flight over all of them (token-id inputs, base64 responses, bodies built before timing), and
stops it. Prints tokens/s per variant, its ratio to the first variant, the front end's CPU use
(1.0 = one core busy all the time: the front end is the limit), how the replicas shared the
tokens, and the worst cosine of the sampled vectors against the first variant's.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing as mp
import re
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
from served import children_of, cpu_seconds, start_server

SAMPLE_REQUESTS = 4  # responses per pass kept to compare variants


@dataclass
class Outcome:
    name: str
    tokens_per_s: float
    seconds: float
    failed: int
    front_cpu: float  # cores the server's front-end processes used during the timed passes
    replica_tokens: dict[str, float]
    samples: np.ndarray  # vectors of the first SAMPLE_REQUESTS requests


def build_bodies(model: Path, workload: str, per_request: int, limit: int | None) -> list[bytes]:
    from pipepool.commands.workloads import make_workload

    hf = json.loads((model / "config.json").read_text())
    max_len = 512 if hf.get("model_type") == "bert" else hf["max_position_embeddings"]
    ids = make_workload(workload, hf["vocab_size"], max_len=max_len, requests=limit).token_ids
    bodies = []
    for lo in range(0, len(ids), per_request):
        chunk = [t.tolist() for t in ids[lo : lo + per_request]]
        bodies.append(json.dumps({"input": chunk, "encoding_format": "base64"}).encode())
    return bodies


# -- client processes ------------------------------------------------------------------------
# A client is plain HTTP/1.1 over asyncio streams: one keep-alive connection per request in
# flight, request bytes built before timing, a response read by its Content-Length. The
# clients share the host's cores with the server's processes, so they must cost little (the
# cores they use are printed with each variant).


def _client_main(url, bodies, indices, concurrency, go, out) -> None:
    try:
        import uvloop  # the clients' own cost is not what is measured

        uvloop.install()
    except ImportError:
        pass
    tokens, failed, samples = asyncio.run(_drive(url, bodies, indices, concurrency, go))
    out.put((tokens, failed, samples, time.process_time()))


async def _drive(url, bodies, indices, concurrency, go) -> tuple[int, int, dict]:
    parts = urlsplit(url)
    head = (
        f"POST /v1/embeddings HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        "Content-Type: application/json\r\nContent-Length: "
    ).encode()
    queue = deque(indices)
    tokens = failed = 0
    samples: dict[int, list] = {}

    async def one() -> None:
        nonlocal tokens, failed
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        while queue:
            i = queue.popleft()
            body = bodies[i % len(bodies)]
            try:
                writer.write(b"%s%d\r\n\r\n%s" % (head, len(body), body))
                header = await reader.readuntil(b"\r\n\r\n")
                length = int(_CONTENT_LENGTH.search(header).group(1))
                data = await reader.readexactly(length)
            except (OSError, asyncio.IncompleteReadError, AttributeError) as exc:
                print(f"request {i}: {exc!r}", flush=True)  # counted, never a hung benchmark
                failed += 1
                writer.close()
                reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
                continue
            if header[9:12] != b"200":
                failed += 1
                continue
            # The answer's usage closes its body: the served tokens, without parsing the rest.
            usage = _PROMPT_TOKENS.search(data, max(0, len(data) - 256))
            if usage is None:
                failed += 1
                continue
            tokens += int(usage.group(1))
            if i < SAMPLE_REQUESTS:
                samples[i] = [d["embedding"] for d in json.loads(data)["data"]]
        writer.close()

    await asyncio.get_running_loop().run_in_executor(None, go.wait)
    await asyncio.gather(*(one() for _ in range(concurrency)))
    return tokens, failed, samples


_CONTENT_LENGTH = re.compile(rb"(?i)\r\ncontent-length: *(\d+)")
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens":(\d+)')


def run_pass(url: str, bodies: list[bytes], clients: int, concurrency: int, repeat: int = 1):
    """All bodies ``repeat`` times, from ``clients`` processes; (seconds, tokens, failed,
    samples, the clients' CPU seconds). A pass is timed from its first request to its last
    answer, so it must be long against the ramp at its ends: a fast server needs ``repeat`` >
    1."""
    ctx = mp.get_context("fork")  # the bodies reach the clients without a copy through pipes
    go, out = ctx.Event(), ctx.Queue()
    per = max(1, concurrency // clients)
    procs = [
        ctx.Process(
            target=_client_main,
            args=(url, bodies, range(k, len(bodies) * repeat, clients), per, go, out),
        )
        for k in range(clients)
    ]
    for p in procs:
        p.start()
    time.sleep(1.0)  # the clients import and connect before the clock starts
    start = time.perf_counter()
    go.set()
    tokens = failed = 0
    client_cpu = 0.0
    samples: dict[int, list] = {}
    for _ in procs:
        t, f, s, cpu = out.get(timeout=900)
        tokens, failed, client_cpu = tokens + t, failed + f, client_cpu + cpu
        samples.update(s)
    seconds = time.perf_counter() - start
    for p in procs:
        p.join()
    return seconds, tokens, failed, samples, client_cpu


# -- a server --------------------------------------------------------------------------------


def start_variant(model: Path, flags: list[str], env_extra: dict[str, str]):
    extra = ["--model", str(model), "--no-access-log", "--allow-token-ids", "--log-level", "info"]
    return start_server([*extra, *flags], env_extra)


def children_running(server_pid: int, module: bytes) -> list[int]:
    """The server's child processes whose command line names ``module``."""
    pids = []
    for pid in children_of().get(server_pid, []):
        try:
            if module in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
        except OSError:
            continue
    return pids


def replica_tokens(url: str) -> dict[str, float]:
    found = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pipepool_replica_prompt_tokens_finished_total{"):
            key, value = line.rsplit(" ", 1)
            found[key.split('"')[1]] = float(value)
    return found


def wait_for_api_servers(url: str, flags: list[str]) -> None:
    """Until every API server process answers (fresh connections land on any of them)."""
    flag = "--api-server-count"
    count = int(flags[flags.index(flag) + 1]) if flag in flags else 1
    seen: set[int] = set()
    deadline = time.monotonic() + 120
    while count > 1 and len(seen) < count and time.monotonic() < deadline:
        body = httpx.get(url + "/health", timeout=10).json()
        seen.add(body.get("api_server", 0))
    if count > 1 and len(seen) < count:
        raise SystemExit(f"only API servers {sorted(seen)} of {count} answered in 120 s")


def run_variant(name, model, flags, env_extra, bodies, args) -> Outcome:
    proc, url = start_variant(model, flags, env_extra)
    try:
        wait_for_api_servers(url, flags)
        t0 = time.perf_counter()
        run_pass(url, bodies, args.clients, args.concurrency, args.repeat)
        print(f"[{name}] warm-up pass {time.perf_counter() - t0:.1f}s", flush=True)
        before_tokens = replica_tokens(url)
        # The server and its other API server processes (--api-server-count); the replicas.
        fronts = [proc.pid, *children_running(proc.pid, b"pipepool.server.api_worker")]
        replicas = children_running(proc.pid, b"pipepool.replicas.worker")
        cpu0 = sum(map(cpu_seconds, fronts))
        rcpu0 = sum(map(cpu_seconds, replicas))
        seconds = tokens = failed = client_cpu = 0
        samples = {}
        for _ in range(args.passes):
            s, t, f, samples, c = run_pass(url, bodies, args.clients, args.concurrency, args.repeat)
            seconds, tokens, failed = seconds + s, tokens + t, failed + f
            client_cpu += c
        front_cpu = (sum(map(cpu_seconds, fronts)) - cpu0) / seconds
        replica_cpu = (sum(map(cpu_seconds, replicas)) - rcpu0) / seconds
        after = replica_tokens(url)
        shares = {k: after[k] - before_tokens.get(k, 0.0) for k in after}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    vectors = np.stack(
        [_decode(e) for i in sorted(samples) for e in samples[i]]
    ) if samples else np.zeros((0, 1), np.float32)  # fmt: skip
    out = Outcome(name, tokens / seconds, seconds, failed, front_cpu, shares, vectors)
    print(
        f"[{name}] {out.tokens_per_s:,.0f} tok/s over {seconds:.1f}s, {failed} failed, "
        f"{len(fronts)} front-end process(es) {front_cpu:.2f} cores, {len(replicas)} replica "
        f"process(es) {replica_cpu:.2f} cores, {args.clients} clients {client_cpu / seconds:.2f} "
        f"cores, replica tokens {shares}",
        flush=True,
    )
    return out


def _decode(embedding: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(embedding), dtype="<f4")


def _worst_cosine(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape or not len(a):
        return float("nan")
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument(
        "--workload", default="W1", help="a token-id workload of pipepool.commands.workloads"
    )
    p.add_argument("--requests", type=int, help="only the first N inputs of the workload")
    p.add_argument("--inputs-per-request", type=int, default=4)
    p.add_argument("--passes", type=int, default=2, help="timed passes over the workload")
    p.add_argument("--repeat", type=int, default=1, help="times each pass sends the workload")
    p.add_argument("--clients", type=int, default=8, help="client processes")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight, in all")
    p.add_argument("--flags", default="", help="serve flags for every variant")
    p.add_argument(
        "--variant", action="append", required=True, help="NAME|ENV|FLAGS (first: the baseline)"
    )
    args = p.parse_args()
    bodies = build_bodies(args.model, args.workload, args.inputs_per_request, args.requests)
    per = args.inputs_per_request
    print(f"{args.workload}: {len(bodies)} requests of {per} inputs", flush=True)
    outcomes = []
    for spec in args.variant:
        name, env_text, flags = spec.split("|")
        env_extra = dict(kv.split("=", 1) for kv in env_text.split())
        flags = args.flags.split() + flags.split()
        outcomes.append(run_variant(name, args.model, flags, env_extra, bodies, args))
    base = outcomes[0]
    print(f"\n{args.model.name} {args.workload} through the server ({args.concurrency} in flight)")
    print(f"{'variant':10}{'tok/s':>14}{'ratio':>8}{'failed':>8}{'front CPU':>11}  cos vs base")
    for o in outcomes:
        cos = _worst_cosine(o.samples, base.samples)
        print(
            f"{o.name:10}{o.tokens_per_s:14,.0f}{o.tokens_per_s / base.tokens_per_s:8.2f}"
            f"{o.failed:8d}{o.front_cpu:11.2f}  {cos:.5f}"
        )
    return 0 if all(o.failed == 0 for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
