"""Served ``/v1/embeddings`` by server variant, with the CPU time each kind of server process
spends a request: which process is the bound (issue 61, item 3).

    python benchmarks/served_processes.py --shape minilm --device cuda \\
        --variant "4 front ends||--api-server-count 4" \\
        --variant "8 front ends||--api-server-count 8" \\
        --variant "tokenizer threads 4|RAYON_NUM_THREADS=4|"

Each ``--variant LABEL|ENV=V,ENV=V|SERVE FLAGS`` is a ``pipepool serve`` of its own, one after
the other, on the same checkpoint (``served_text.build_checkpoint``) and texts
(``served_text.texts_of``); ENV goes to the server's environment only. For each variant and
each ``--per-request`` size: one warm-up pass, then ``--passes`` timed passes of the texts
sent as many times as it takes to make ``--pass-requests`` requests (16 x ``--concurrency``
by default, as ``served_text.py``; base64, the model's name, bodies built before the clock,
``dp_server.run_pass``'s client processes), each printing requests/s, texts/s and, from
``/proc`` before and after the pass, the CPU time a request of the server's processes by kind
(the first front end, which is the ``serve`` process itself; the other front ends,
``api_worker``; the replicas, ``replicas.worker``; anything else, by its command line), with
how many there are; the clients' CPU a request; and the mean of ``/metrics``'s
``pipepool_replica_busy_fraction`` over the pass. A kind whose CPU a request times the
requests/s comes to about one core a process is bound by its interpreter lock. After each
variant's passes, every process of no named kind is listed with its whole command line and
the CPU seconds it used since it started.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
from dp_server import run_pass
from served import cpu_seconds, descendants, start_server
from served_text import SHAPES, WORD_RANGES, build_checkpoint, openai_bodies, texts_of

# Command-line marks of the server's processes, in the order they are tested.
KINDS = ("api_worker", "replicas.worker", "pipepool serve")


def command_line(pid: int) -> str:
    """Process ``pid``'s command line, its arguments joined by spaces (OSError if gone)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def kind(pid: int) -> str:
    try:
        command = command_line(pid)
    except OSError:
        return "exited"
    return next((k for k in KINDS if k in command), command[:40])


def cpu_by_process(root: int) -> dict[int, tuple[str, float]]:
    """(kind, CPU seconds) of ``root`` and every process below it."""
    found = {}
    for pid in descendants(root):
        try:
            found[pid] = (kind(pid), cpu_seconds(pid))
        except OSError:
            continue
    return found


def others(root: int) -> list[str]:
    """A line for each process below ``root`` of no kind in ``KINDS``: its pid, CPU seconds
    since it started and whole command line (the table names it by 40 characters)."""
    lines = []
    for pid in descendants(root):
        try:
            command, cpu = command_line(pid), cpu_seconds(pid)
        except OSError:
            continue
        if not any(k in command for k in KINDS):
            lines.append(f"  pid {pid}, {cpu:.1f} s CPU: {command[:300]}")
    return lines


def busy_fractions(url: str, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        try:
            for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
                if line.startswith("pipepool_replica_busy_fraction"):
                    out.append(float(line.rsplit(" ", 1)[1]))
        except httpx.HTTPError:
            pass
        stop.wait(0.5)


def measure(url: str, root: int, bodies: list[bytes], texts_each: int, args) -> str:
    """One timed pass, as a line."""
    repeat = -(-args.pass_requests // len(bodies))
    before = cpu_by_process(root)
    stop, busy = threading.Event(), []
    sampler = threading.Thread(target=busy_fractions, args=(url, stop, busy))
    sampler.start()
    seconds, _, failed, _, client_cpu = run_pass(
        url, bodies, args.clients, args.concurrency, repeat
    )
    stop.set()
    sampler.join()
    after = cpu_by_process(root)
    requests = len(bodies) * repeat
    spent: dict[str, list] = {}
    for pid, (name, cpu) in after.items():
        entry = spent.setdefault(name, [0.0, 0])
        entry[0] += cpu - before.get(pid, (name, 0.0))[1]
        entry[1] += 1
    kinds = ", ".join(
        f"{name} x{count} {cpu * 1e6 / requests:,.0f} us"
        for name, (cpu, count) in sorted(spent.items(), key=lambda item: -item[1][0])
        if cpu > 0
    )
    fraction = f"{sum(busy) / len(busy):.2f}" if busy else "n/a"
    return (
        f"{requests / seconds:,.0f} requests/s, {requests * texts_each / seconds:,.0f} texts/s, "
        f"{failed} failed; server CPU a request: {kinds}; clients "
        f"{client_cpu * 1e6 / requests:,.0f} us; replica busy {fraction}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=SHAPES, default="tiny")
    p.add_argument("--model", type=Path, help="a model folder instead of --shape")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--workload", choices=WORD_RANGES, default="queries")
    p.add_argument("--texts", type=int, default=16384)
    p.add_argument("--per-request", default="1,32", help="texts per request, a list")
    p.add_argument(
        "--pass-requests", type=int, help="requests a pass at least (default 16 x --concurrency)"
    )
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--clients", type=int, default=6, help="client processes")
    p.add_argument("--concurrency", type=int, default=384, help="requests in flight, in all")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        help="LABEL|ENV=V,ENV=V|SERVE FLAGS; repeat it (default: one server, no extra)",
    )
    args = p.parse_args()
    if args.pass_requests is None:
        args.pass_requests = 16 * args.concurrency
    cuda = args.device == "cuda"
    model = args.model or build_checkpoint(args.shape, {}, cuda)
    texts = texts_of(model, args.workload, args.texts)
    flags = ["--model", str(model), "--no-access-log", "--log-level", "warning",
             "--device", args.device, "--max-model-len", "512",
             *(["--dtype", "bfloat16"] if cuda else [])]  # fmt: skip
    print(f"{model.name}, {args.workload}: {len(texts)} texts", flush=True)
    for variant in args.variant or ["default||"]:
        label, envs, extra = variant.split("|")
        env = dict(pair.split("=", 1) for pair in envs.split(",") if pair)
        start = time.monotonic()
        proc, url = start_server([*flags, *extra.split()], env)
        print(f"== {label}: ready in {time.monotonic() - start:.1f} s", flush=True)
        try:
            for n in (int(x) for x in args.per_request.split(",") if x):
                bodies = openai_bodies(url, texts, n)
                run_pass(url, bodies[: max(1, len(bodies) // 4)], args.clients, args.concurrency)
                for _ in range(args.passes):
                    line = measure(url, proc.pid, bodies, n, args)
                    print(f"{label}, {n}/request: {line}", flush=True)
            for line in others(proc.pid):
                print(line, flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
