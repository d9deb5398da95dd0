"""The server's Python work per ``/v1/embeddings`` request, counted, not timed: a figure the
machine's load does not change, for A/B runs of the request path on a busy machine.

    python benchmarks/served_calls.py --tree OLD/src --tree src --concurrency 64
    python benchmarks/served_calls.py --tree OLD/src --tree src --concurrency 1 --requests 400

Each ``--tree`` is a ``src`` folder put first on the server's ``PYTHONPATH``. Its server
(``served_text``'s ``tiny`` checkpoint on the CPU) runs under a profile hook installed before
pipepool is imported (``sys.setprofile`` and ``threading.setprofile``: every thread the server
starts), which counts each Python function call (generator and coroutine resumptions
included) and each call of a C function made from Python, per thread. After ``--warm``
requests the counts are reset (``SIGUSR1``); ``--requests`` requests follow from
``--concurrency`` keep-alive connections (bodies as the ``openai`` client sends them: base64,
the model's name, ``--per-request`` texts each), then the server writes its counts
(``SIGUSR2``), and ``/metrics`` gives the engine steps they took.

One request at a time (``--concurrency 1``) makes one engine step a request: the counts per
request are then the same from run to run up to the idle polls of waiting threads. With
requests in flight, how many share a step depends on timing (and the hook slows the server
several times), so the steps taken are printed beside the counts: the engine thread's counts
per request follow them.

It prints, per tree, the engine steps, and Python calls and C calls per request by thread
(the event loop is ``MainThread``; the engine's steps run on ``pipepool-engine``), then, for
each later tree against the first, the functions whose calls per request changed most. Only
the counts mean anything, not the time the run takes.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from served import free_port

# Run in the server's process (``--child``): the hook, then pipepool's command line.
_CHILD = r"""
import collections, json, os, signal, sys, threading
counts = collections.Counter()
def hook(frame, event, arg, _get=threading.get_ident):
    if event == "call":
        code = frame.f_code
        counts[(_get(), "py", code.co_filename, code.co_firstlineno, code.co_qualname)] += 1
    elif event == "c_call":
        counts[(_get(), "c", getattr(arg, "__module__", None) or "", 0, arg.__qualname__)] += 1
def reset(*_):
    counts.clear()
def dump(*_):
    names = {t.ident: t.name for t in threading.enumerate()}
    rows = [[names.get(k[0], "ended"), *k[1:], n] for k, n in list(counts.items())]
    with open(os.environ["CALLS_OUT"] + ".tmp", "w") as f:
        json.dump(rows, f)
    os.replace(os.environ["CALLS_OUT"] + ".tmp", os.environ["CALLS_OUT"])
signal.signal(signal.SIGUSR1, reset)
signal.signal(signal.SIGUSR2, dump)
threading.setprofile(hook)
sys.setprofile(hook)
sys.argv = ["pipepool", *sys.argv[1:]]
from pipepool.commands.cli import run_as_program
run_as_program()
"""


def thread_group(name: str) -> str:
    """A thread's name without its serial number (``ThreadPoolExecutor-0_3`` -> ``...-N_N``)."""
    return re.sub(r"\d+", "N", name)


def post(conn: http.client.HTTPConnection, body: bytes) -> None:
    conn.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
    answer = conn.getresponse()
    data = answer.read()
    if answer.status != 200:
        raise SystemExit(f"HTTP {answer.status}: {data[:300]!r}")


def steps_total(port: int) -> float:
    """The server's ``pipepool_steps_total`` (step plans scheduled so far)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("GET", "/metrics")
    for line in conn.getresponse().read().decode().splitlines():
        if line.startswith("pipepool_steps_total"):
            return float(line.split()[-1])
    raise SystemExit("no pipepool_steps_total in /metrics")


def send_all(port: int, bodies: list[bytes], concurrency: int) -> None:
    """Every body, ``concurrency`` keep-alive connections at a time (threads of this process)."""
    from concurrent.futures import ThreadPoolExecutor

    def lane(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        for body in bodies[k::concurrency]:
            post(conn, body)
        conn.close()

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lane, range(concurrency)))


def count(model: Path, texts: list[str], tree: str, args) -> tuple[list, float]:
    """The server on ``tree``'s call counts over ``args.requests`` requests (rows of thread,
    kind, file, line, name, calls), and the engine steps they took."""
    port = free_port()
    out = Path(tempfile.mkdtemp()) / "calls.json"
    cmd = [sys.executable, "-c", _CHILD, "serve", "--port", str(port), "--model", str(model)]
    cmd += ["--no-access-log", "--device", "cpu", "--max-model-len", "512"]
    cmd += args.serve_flags.split()
    env = {**os.environ, "PYTHONPATH": tree, "CALLS_OUT": str(out)}
    proc = subprocess.Popen(cmd, env=env)
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server on {tree} did not start")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                conn.request("GET", "/health")
                answer = conn.getresponse()
                answer.read()
                if answer.status == 200:  # the model is loaded
                    conn.request("GET", "/v1/models")
                    name = json.loads(conn.getresponse().read())["data"][0]["id"]
                    break
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.5)
        n = args.per_request
        bodies = [
            json.dumps(
                {"input": texts[(i * n) % len(texts) :][:n], "model": name,
                 "encoding_format": "base64"}
            ).encode()
            for i in range(args.warm + args.requests)
        ]  # fmt: skip
        send_all(port, bodies[: args.warm], args.concurrency)
        time.sleep(1.0)  # the warm pass's trailing work ends before the reset
        steps = steps_total(port)
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        send_all(port, bodies[args.warm :], args.concurrency)
        time.sleep(0.5)
        proc.send_signal(signal.SIGUSR2)
        while not out.exists():
            time.sleep(0.2)
        return json.loads(out.read_text()), steps_total(port) - steps
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


def summary(rows: list, requests: int) -> dict[str, tuple[float, float]]:
    """(Python calls, C calls) per request by thread group, and ``all``."""
    py: Counter = Counter()
    c: Counter = Counter()
    for thread, kind, _, _, _, calls in rows:
        for key in (thread_group(thread), "all"):
            (py if kind == "py" else c)[key] += calls
    return {k: (py[k] / requests, c[k] / requests) for k in sorted(set(py) | set(c))}


def by_function(rows: list, requests: int) -> Counter:
    """Calls per request by (thread group, kind, where, name)."""
    found: Counter = Counter()
    for thread, kind, file, line, name, calls in rows:
        where = f"{file.split('/src/')[-1].split('site-packages/')[-1]}:{line}" if line else file
        found[(thread_group(thread), kind, where, name)] += calls / requests
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tree", action="append", required=True, help="a src folder; repeat for A/B")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--warm", type=int, default=100)
    p.add_argument("--per-request", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight")
    p.add_argument("--top", type=int, default=30, help="functions to list that differ most")
    p.add_argument("--serve-flags", default="", help="more pipepool serve flags")
    p.add_argument("--save", help="write every tree's counts to this JSON file")
    args = p.parse_args()
    from served_text import build_checkpoint, texts_of

    model = build_checkpoint("tiny", {}, cuda=False)
    texts = texts_of(model, "queries", 4096)
    counted = {tree: count(model, texts, tree, args) for tree in args.tree}
    results = {tree: rows for tree, (rows, _) in counted.items()}
    if args.save:
        Path(args.save).write_text(json.dumps(counted))
    print(f"\ncalls per request ({args.per_request} text(s) each), Python / C, by thread:")
    for tree, rows in results.items():
        steps = counted[tree][1]
        print(f"  {tree}: {steps:.0f} engine steps ({args.requests / steps:.2f} requests a step)")
        for group, (py, c) in summary(rows, args.requests).items():
            print(f"    {group:32s} {py:10.1f} {c:10.1f}")
    first = by_function(results[args.tree[0]], args.requests)
    for tree in args.tree[1:]:
        other = by_function(results[tree], args.requests)
        diff = {k: other.get(k, 0.0) - first.get(k, 0.0) for k in set(first) | set(other)}
        print(f"\n{tree} against {args.tree[0]}: calls per request, most changed first")
        for key in sorted(diff, key=lambda k: -abs(diff[k]))[: args.top]:
            thread, kind, where, name = key
            print(
                f"  {diff[key]:+9.2f} ({first.get(key, 0.0):8.2f} -> {other.get(key, 0.0):8.2f})"
                f" {thread} {kind} {name} {where}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
