"""CPU lanes A/B: ``Engine()`` at its defaults with a step's tiles on single-threaded lanes (as
shipped, ``layers/cpu_lanes.py``) and without (one tile at a time on every intra-op thread,
the path before the lanes), beside ONNX Runtime fp32, in one process, rounds interleaved.

    python benchmarks/cpu_lanes.py                          # T5 and T6, 5 rounds, 2 threads
    python benchmarks/cpu_lanes.py --workload T5 --rounds 9 --fraction 0.5

Same texts for every arm (``pipepool bench``'s T5 queries / T6 passages, the first
``--fraction`` of them), tokenisation included, ``--threads`` intra-op threads for each.
ONNX Runtime runs ``pipepool bench --cpu-peers``' peer (the bundled model exported with
``torch.onnx.export``, ``ORT_ENABLE_ALL``) at batch size ``--ort-batch-size``. Each round times
every arm once, the order rotated a step a round; the ratios are taken round by round, so a
burst of load from elsewhere falls on the arms of one round alike. Needs pipepool[bench-cpu].
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import pipepool
from pipepool.commands import cpu_peers
from pipepool.commands.workloads import make_texts, vocabulary_words
from pipepool.layers import cpu_lanes


def engine_arm(engine: pipepool.Engine, lanes: bool) -> Callable[[list[str]], np.ndarray]:
    real = cpu_lanes.lanes_here

    def embed(texts: list[str]) -> np.ndarray:
        # The engine asks for its lanes at every step: none makes it run the tiles one by one.
        cpu_lanes.lanes_here = real if lanes else lambda: None
        try:
            return engine.embed(texts)
        finally:
            cpu_lanes.lanes_here = real

    return embed


def rounds(arms: dict, texts: list[str], count: int) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for r in range(count):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            arms[name](texts)
            rates[name].append(len(texts) / (time.perf_counter() - start))
        print(f"  round {r + 1}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in rates.items()))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="T5,T6")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fraction", type=float, default=1.0, help="of each workload's texts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ort-batch-size", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with contextlib.ExitStack() as stack:
        engine = stack.enter_context(pipepool.Engine(device="cpu"))  # else its defaults
        d = engine.pipeline.deployment
        st = cpu_peers.reference_model(d.folder.path, d.pooling, d.max_model_len)
        tokenizer = cpu_peers.text_tokenizer(d.folder.tokenizer_file, st)
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pipepool-onnx-")))
        exported = cpu_peers.export_onnx(st, folder / "fp32" / "model.onnx")
        ort = cpu_peers.OrtPeer(exported, tokenizer, args.threads)
        arms = {
            "lanes": engine_arm(engine, lanes=True),
            "no lanes": engine_arm(engine, lanes=False),
            "onnxruntime fp32": lambda texts: ort.encode(texts, args.ort_batch_size),
        }
        words = vocabulary_words(d.folder.tokenizer_file)
        for workload in args.workload.split(","):
            texts = make_texts(workload, words)
            texts = texts[: max(1, int(len(texts) * args.fraction))]
            for arm in arms.values():
                arm(texts[:64])  # first calls: allocations, oneDNN's weight packing
            print(f"{workload}: {len(texts)} texts, {args.threads} threads, texts/s")
            rates = rounds(arms, texts, args.rounds)
            peer = rates["onnxruntime fp32"]
            for name, rate in rates.items():
                ratio = [a / b for a, b in zip(rate, peer, strict=True)]
                print(
                    f"  {name}: median {statistics.median(rate):.1f} texts/s, "
                    f"x ONNX Runtime fp32 median {statistics.median(ratio):.2f} "
                    f"(rounds {min(ratio):.2f}-{max(ratio):.2f})"
                )


if __name__ == "__main__":
    main()
