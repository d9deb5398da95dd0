"""The server process's CPU time per ``/v1/embeddings`` request, from ``/proc``: a figure the
machine's load does not change much (unlike texts/s), for A/B runs of the request path.

    python benchmarks/served_cpu.py --tree /work/main/src --tree src --rounds 3

Each ``--tree`` is a ``src`` folder put first on the server's ``PYTHONPATH`` (the code under
test); the trees' servers are started one after the other each round, so that A and B
alternate within the same minutes. For each server and each ``--per-request`` size, one pass
of the texts (``served_text``'s queries on its ``tiny`` shape, bodies as the ``openai`` client
sends them: base64, the model's name) from ``--clients`` processes, after a warm pass; it
prints the server's CPU seconds per request and per text: all its threads (user + system), and
its main thread alone (the event loop's: HTTP, routing, checks, small requests' tokenising and
answers; the engine's steps and the tokenising lanes run on other threads), and how many
requests shared an engine step (``/metrics``' ``pipepool_steps_total``: fewer, larger steps
cost less a request).
"""

from __future__ import annotations

import argparse
import signal
import sys

import httpx
from dp_server import run_pass
from served import cpu_seconds, start_server
from served_text import build_checkpoint, openai_bodies, texts_of


def steps_total(url: str) -> float:
    """The server's ``pipepool_steps_total`` (engine steps planned so far)."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pipepool_steps_total"):
            return float(line.split()[-1])
    raise SystemExit("no pipepool_steps_total in /metrics")


def measure(model, texts: list[str], tree: str, sizes: list[int], args) -> dict:
    """(all threads', event loop's) server CPU seconds per request, by texts per request, of the
    server on ``tree``."""
    flags = ["--model", str(model), "--no-access-log", "--device", "cpu"]
    flags += ["--max-model-len", "512", *args.serve_flags.split()]
    proc, url = start_server(flags, {"PYTHONPATH": tree})
    try:
        out = {}
        for n in sizes:
            bodies = openai_bodies(url, texts, n)
            run_pass(url, bodies[: max(1, len(bodies) // 4)], args.clients, args.concurrency)
            steps = steps_total(url)
            before = cpu_seconds(proc.pid), cpu_seconds(proc.pid, proc.pid)
            seconds, _, failed, _, _ = run_pass(url, bodies, args.clients, args.concurrency)
            if failed:
                raise SystemExit(f"{failed} requests failed")
            every = (cpu_seconds(proc.pid) - before[0]) / len(bodies)
            loop = (cpu_seconds(proc.pid, proc.pid) - before[1]) / len(bodies)
            steps = steps_total(url) - steps
            out[n] = (every, loop)
            print(
                f"{tree}: {n}/request {every * 1e3:.3f} ms CPU a request ({every / n * 1e6:.0f} "
                f"us a text), event loop {loop * 1e3:.3f} ms; {len(bodies) / seconds:,.0f} "
                f"requests/s; {len(bodies) / steps:.1f} requests an engine step",
                flush=True,
            )
        return out
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tree", action="append", required=True, help="a src folder; repeat for A/B")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--texts", type=int, default=4096)
    p.add_argument("--per-request", default="1,32")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--serve-flags", default="", help="more pipepool serve flags")
    args = p.parse_args()
    model = build_checkpoint("tiny", {}, cuda=False)
    texts = texts_of(model, "queries", args.texts)
    sizes = [int(x) for x in args.per_request.split(",")]
    results: dict[str, list[dict]] = {tree: [] for tree in args.tree}
    for _ in range(args.rounds):
        for tree in args.tree:
            results[tree].append(measure(model, texts, tree, sizes, args))
    print("\nserver CPU per request in ms (all threads / event loop), median of rounds:")
    for tree, rounds in results.items():
        cells = []
        for n in sizes:
            every = sorted(r[n][0] for r in rounds)[len(rounds) // 2]
            loop = sorted(r[n][1] for r in rounds)[len(rounds) // 2]
            cells.append(f"{n}/request {every * 1e3:.3f} / {loop * 1e3:.3f}")
        print(f"  {tree}: " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
