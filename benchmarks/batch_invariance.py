"""What ``batch_invariant`` costs: texts/s of the same engine with the option off and on,
same texts, same process, rounds interleaved (issue 60; docs/batch-invariance.md).

    python benchmarks/batch_invariance.py --device cuda                 # MiniLM and 0.6B shapes
    python benchmarks/batch_invariance.py --device cpu --models minilm --texts 1000

``minilm``: the bundled all-MiniLM-L6-v2 (real weights). ``0.6b``: a random-weight checkpoint
of Qwen3-Embedding-0.6B's config (built once under /tmp/pipepool-bench by gpu_suite.py's
builder). On CUDA each engine has half the GPU. The rounds start once the default mode's
background compile is done (its compiled layers are what it runs for good) and each engine has
embedded the texts once (every step size's graphs captured). Each round embeds the texts once
per mode, alternating which goes first, so a burst of load from other processes hits both
alike. Reported per model: best and median texts/s of each mode, the cost (1 - on / off, best
against best and median against median), whether the first texts' vectors were the same bits
alone and inside the batch with the option on, and the minimum cosine between the two modes'
vectors.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import pipepool

HERE = Path(__file__).resolve().parent
COMPILE_WAIT_S = 300  # longest wait for the default mode's background compile


def model_folder(key: str) -> str:
    sys.path.insert(0, str(HERE))
    import gpu_suite

    return str(gpu_suite.minilm_folder() if key == "minilm" else gpu_suite.build_checkpoint(key))


def make_texts(count: int, seed: int) -> list[str]:
    """``count`` texts of 5 to 60 words (short queries and passages, the usual pooling load)."""
    words = [
        "the",
        "a",
        "of",
        "retrieval",
        "index",
        "vector",
        "engine",
        "batch",
        "query",
        "passage",
        "model",
        "text",
        "chunk",
    ]
    words += [f"term{i}" for i in range(400)]
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(words, size=rng.integers(5, 61))) for _ in range(count)]


def measure(model: str, texts: list[str], rounds: int, options: dict) -> dict:
    engines = {
        mode: pipepool.Engine(model, batch_invariant=mode == "on", **options)
        for mode in ("off", "on")
    }
    try:
        engines["off"].embed(texts[:64])
        # The default mode compiles its layers in the background: timed once that is done.
        compiled = engines["off"].pipeline.wait_until_compiled(COMPILE_WAIT_S)
        for engine in engines.values():
            engine.embed(texts)  # warm: every step size's kernels chosen and graphs captured
        seconds: dict[str, list[float]] = {"off": [], "on": []}
        vectors = {}
        for r in range(rounds):
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                start = time.perf_counter()
                vectors[mode] = np.asarray(engines[mode].embed(texts))
                seconds[mode].append(time.perf_counter() - start)
        alone = np.stack([engines["on"].embed([t])[0] for t in texts[:8]])
        bits = all(np.array_equal(a, b) for a, b in zip(alone, vectors["on"][:8], strict=True))
    finally:
        for engine in engines.values():
            engine.close()
    off, on = vectors["off"], vectors["on"]
    cos = (off * on).sum(1) / np.linalg.norm(off, axis=1) / np.linalg.norm(on, axis=1)
    return {"seconds": seconds, "bits": bits, "min_cos": float(cos.min()), "compiled": compiled}


def default_texts(key: str, device: str) -> int:
    """Texts a pass: on CUDA enough for a pass of either mode to last seconds (a pass of 20,000
    short texts takes MiniLM a quarter of a second, too short to hold the default's rate
    still: 65-88k texts/s between runs, 116-120k at 100,000 on the same kind of host)."""
    if device != "cuda":
        return 1000
    return 100_000 if key == "minilm" else 20_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--models", default="minilm,0.6b", help="minilm and/or 0.6b")
    parser.add_argument(
        "--texts", type=int, default=None,
        help="texts a pass (default: on CUDA 100000 for minilm, 20000 for 0.6b; 1000 on the CPU)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    options: dict = {"device": args.device}
    if args.device == "cuda":
        # Two engines on one GPU: each takes half of it (by default the first would leave the
        # second too little for its working set).
        options.update(dtype="bfloat16", gpu_memory_share=0.5)
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    print(f"{args.rounds} rounds, {options}")
    for key in args.models.split(","):
        count = args.texts or default_texts(key, args.device)
        texts = make_texts(count, args.seed)
        result = measure(model_folder(key), texts, args.rounds, options)
        s = result["seconds"]
        rate = {m: (count / min(s[m]), count / statistics.median(s[m])) for m in s}
        best_cost = 1 - rate["on"][0] / rate["off"][0]
        median_cost = 1 - rate["on"][1] / rate["off"][1]
        print(
            f"{key:7s} {count} texts | off {rate['off'][0]:9.1f} best "
            f"{rate['off'][1]:9.1f} median texts/s | "
            f"on {rate['on'][0]:9.1f} best {rate['on'][1]:9.1f} median | "
            f"cost {best_cost:+.1%} (best) {median_cost:+.1%} (median) | "
            f"alone == in batch: {result['bits']} | min cos off/on {result['min_cos']:.6f} | "
            f"off compiled before the rounds: {result['compiled']}"
        )


if __name__ == "__main__":
    main()
