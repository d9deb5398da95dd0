"""The engine's host cost of one-input calls: what a served one-text request costs the process
that computes it, without HTTP and without the model's compute (issue 61, item 3).

    python benchmarks/one_text_engine.py [--shape tiny] [--requests 10000] [--rounds 3]
    python benchmarks/one_text_engine.py --tree /tmp/main/src --tree src   # A/B, alternated

On the CPU, the layers of ``served_text.build_checkpoint(shape)`` answer zeros
(``host_time.stub_forward``), so what is left is the host's work around them: the caller's
``Engine.submit`` (validation, tokenising a text, the call's future, the pipeline's queue) and
the engine's loop thread (scheduling, the step's inputs, pooling and delivery of the zeros).
Each round submits ``--requests`` calls of one input each from one thread, first token ids
then texts (``served_text.texts_of``), all at once, then waits for them; it prints calls/s
and the CPU time a call of the calling thread (``time.thread_time``) and of the loop thread
(``/proc``), and the steps those calls took; then all the token ids in one call, for
comparison. ``--frame N`` (repeatable) then sends the same token ids, as one-input works of
one client, to a replica's server (``replicas.worker.ReplicaServer``, over a socket pair in
this process) N works a frame, and prints works/s and the CPU a work of the replica's reader,
sender and loop threads. ``--tree DIR`` (repeatable) runs the same in a fresh process with
that ``src`` first on the path, the trees alternated round by round.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from served import cpu_seconds

HERE = Path(__file__).resolve().parent


def thread_cpu(name: str) -> float:
    """CPU seconds of this process's thread called ``name``."""
    for t in threading.enumerate():
        if t.name == name and t.native_id is not None:
            return cpu_seconds(os.getpid(), t.native_id)
    raise LookupError(f"no thread {name}")


def measure(shape: str, requests: int, rounds: int, frames: list[int]) -> None:
    from host_time import stub_forward
    from served_text import build_checkpoint, texts_of

    import pipepool

    model = build_checkpoint(shape, {}, False)
    texts = texts_of(model, "queries", requests)
    options = {"device": "cpu", "max_model_len": 512, "tokenizer_processes": 0}
    with pipepool.Engine(str(model), **options) as engine:
        ids = engine.tokenize(texts)
        stub_forward(engine)
        engine.embed(ids[:2048])  # warm
        for _ in range(rounds):
            for label, inputs in (("token ids", ids), ("texts", texts)):
                steps = engine.pipeline.stats.snapshot().steps
                loop, caller = thread_cpu("pipepool-engine"), time.thread_time()
                wall = time.perf_counter()
                calls = [engine.submit([x]) for x in inputs]
                caller = time.thread_time() - caller
                for call in calls:
                    call.result()
                wall = time.perf_counter() - wall
                loop = thread_cpu("pipepool-engine") - loop
                steps = engine.pipeline.stats.snapshot().steps - steps
                n = len(inputs)
                print(
                    f"{label:9s}: {n / wall:8,.0f} calls/s; CPU a call: caller "
                    f"{caller * 1e6 / n:6.1f} us, loop thread {loop * 1e6 / n:6.1f} us; "
                    f"{n / steps:5.1f} calls a step",
                    flush=True,
                )
        wall = time.perf_counter()
        engine.embed(ids)
        wall = time.perf_counter() - wall
        print(f"the same token ids in one call: {len(ids) / wall:,.0f} inputs/s", flush=True)
        for frame in frames:
            for _ in range(rounds):
                through_replica(engine, ids, frame)


def through_replica(engine, ids: list[list[int]], frame: int) -> None:
    """The same one-input token ids as a front end sends them to a replica process
    (``replicas.worker.ReplicaServer`` over a socket pair, in this process), all of one local
    client as the server sends them: frames of ``frame`` works each, all sent before any
    result is read; the CPU a work of the replica's threads (its reader, its sender, the
    engine's loop)."""
    import socket
    from multiprocessing.connection import Connection

    import numpy as np

    from pipepool.core.request import PoolingParams
    from pipepool.replicas.messages import Report, Stop, Work, receive, send
    from pipepool.replicas.worker import ReplicaServer

    front, back = socket.socketpair()
    front_conn, back_conn = Connection(front.detach()), Connection(back.detach())
    server = ReplicaServer(engine.pipeline, back_conn, owner=False)
    reader = threading.Thread(target=server.run, name="replica-reader", daemon=True)
    reader.start()
    params = PoolingParams("mean", normalize=True)
    client = "address:127.0.0.1"  # the server's turn key of a local client (front_door.py)
    works = [
        Work(i, np.asarray(x, np.int64), np.array([len(x)], np.int64), params, client=client)
        for i, x in enumerate(ids)
    ]
    frames = [works[i : i + frame] for i in range(0, len(works), frame)]
    threads = ("replica-reader", "replica-sender", "pipepool-engine")
    before = [thread_cpu(t) for t in threads]
    wall = time.perf_counter()
    sender = threading.Thread(target=lambda: [send(front_conn, f) for f in frames])
    sender.start()
    answered = 0
    while answered < len(works):
        for message in receive(front_conn):
            if isinstance(message, Report):
                answered += sum(len(r.rows) for r in message.results)
    wall = time.perf_counter() - wall
    after = [thread_cpu(t) for t in threads]
    sender.join()
    send(front_conn, [Stop()])
    reader.join(timeout=5)
    front_conn.close()
    n = len(works)
    spent = zip(threads, before, after, strict=True)
    cpu = ", ".join(f"{t} {(b - a) * 1e6 / n:5.1f}" for t, a, b in spent)
    print(
        f"replica, frames of {frame:3d}: {n / wall:8,.0f} works/s; CPU a work (us): {cpu}",
        flush=True,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="tiny", help="a served_text.py shape (CPU: tiny)")
    p.add_argument("--requests", type=int, default=10000, help="one-input calls a round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tree", action="append", default=[], help="a src directory to A/B")
    p.add_argument(
        "--frame",
        dest="frames",
        type=int,
        action="append",
        default=[],
        help="also send the token ids to a replica server, this many works a frame",
    )
    args = p.parse_args()
    if not args.tree:
        measure(args.shape, args.requests, args.rounds, args.frames)
        return 0
    for round_ in range(args.rounds):
        for tree in args.tree:
            print(f"== round {round_ + 1}, {tree}", flush=True)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, str(HERE)])}
            command = [sys.executable, __file__, "--shape", args.shape,
                       "--requests", str(args.requests), "--rounds", "1",
                       *(f"--frame={f}" for f in args.frames)]  # fmt: skip
            subprocess.run(command, env=env, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
