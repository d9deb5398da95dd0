"""Rerank throughput in pairs/s: the engine against sentence-transformers'
``CrossEncoder.predict`` at its best batch size, on the same pairs, in the same process and
the same run (issue 13 item 6).

    python benchmarks/rerank.py --shape ms-marco-minilm-l6-v2     # on CUDA: bf16, both sides
    python benchmarks/rerank.py --shape qwen3-reranker-0.6b
    python benchmarks/rerank.py --model DIR                        # a real checkpoint folder
    python benchmarks/rerank.py --shape ms-marco-minilm-l6-v2 --device cpu --pairs 256

A ``--shape`` is a checkpoint of random weights (seed 0) from the real config in
benchmarks/configs/, built once under /tmp/pipepool-bench: ms-marco-MiniLM-L6-v2 with its own
tokenizer (all-MiniLM-L6-v2's files: the same bert-base-uncased vocabulary; PIPEPOOL_MINILM_DIR
on machines without the package), Qwen3-Reranker-0.6B with a byte-level BPE tokenizer trained
here on the benchmark's words (the real one is 151k tokens; the model keeps its real vocabulary
size) plus the chat template sentence-transformers reads the model's prompt through.

Pairs: ``--queries`` queries of 4-16 words, each with ``--pairs / --queries`` documents of
30-200 words, drawn from the MiniLM vocabulary with a fixed seed. The engine scores them all in
one call (``Engine.score``, pairwise); the peer runs ``CrossEncoder.predict`` on the same list
at each ``--batch-sizes`` entry. Rounds alternate the two sides, so load from other processes
hits both alike. Printed: best and median pairs/s of each, the ratio against the peer at its
best batch size, tokens per pair, and the largest score difference between the two sides.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import pipepool
from pipepool.config import EngineConfig
from pipepool.intake.pairs import QWEN3_CHAT_TEMPLATE
from pipepool.loading.deployment import plan_deployment

HERE = Path(__file__).resolve().parent
CHECKPOINTS = Path("/tmp/pipepool-bench")
SHAPES = {
    "ms-marco-minilm-l6-v2": ("BertConfig", "BertForSequenceClassification"),
    "qwen3-reranker-0.6b": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma-2-2b-reranker": ("Gemma2Config", "Gemma2ForSequenceClassification"),
}
# Shapes read through all-MiniLM-L6-v2's tokenizer (its [PAD] is id 0, the configs' pad_token_id).
_MINILM_TOKENIZED = ("ms-marco-minilm-l6-v2", "gemma-2-2b-reranker")
_MINILM_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def vocabulary_words() -> list[str]:
    sys.path.insert(0, str(HERE))
    from gpu_suite import minilm_folder

    words = (minilm_folder() / "vocab.txt").read_text().split("\n")
    return [w for w in words if w.isalpha() and len(w) > 2][:5000]


def build_shape(shape: str, dtype: torch.dtype, words: list[str], layers: int | None) -> Path:
    import shutil

    import transformers

    depth = f"-{layers}layers" if layers else ""
    dest = CHECKPOINTS / f"{shape}{depth}-{str(dtype).removeprefix('torch.')}"
    if (dest / "config.json").exists():
        return dest
    config_cls, model_cls = SHAPES[shape]
    raw = json.loads((HERE / "configs" / f"{shape}.json").read_text())
    if layers:
        raw["num_hidden_layers"] = layers
    config = getattr(transformers, config_cls)(**raw)
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = getattr(transformers, model_cls)(config)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(str(dest))
    del model
    if shape in _MINILM_TOKENIZED:
        sys.path.insert(0, str(HERE))
        from gpu_suite import minilm_folder

        for name in _MINILM_FILES:
            shutil.copy(minilm_folder() / name, dest / name)
    else:
        _qwen3_tokenizer(dest, words)
        (dest / "chat_template.jinja").write_text(QWEN3_CHAT_TEMPLATE)
    return dest


def _qwen3_tokenizer(dest: Path, words: list[str]) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8000,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    prompt = QWEN3_CHAT_TEMPLATE + " yes no" * 50
    tok.train_from_iterator([" ".join(words), prompt], trainer)
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok.save(str(dest / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 8192,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(config))


def make_pairs(words: list[str], queries: int, pairs: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    vocab = np.asarray(words)

    def text(lo: int, hi: int) -> str:
        return " ".join(vocab[rng.integers(0, len(vocab), size=rng.integers(lo, hi + 1))])

    qs = [text(4, 16) for _ in range(queries)]
    per_query = max(1, pairs // queries)
    return [q for q in qs for _ in range(per_query)], [text(30, 200) for _ in qs * per_query]


def timed(fn):
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--shape", choices=sorted(SHAPES))
    which.add_argument("--model", type=Path, help="a real checkpoint folder")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--pairs", type=int, default=4096)
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-sizes", default="32,64,128,256", help="CrossEncoder.predict's")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument(
        "--layers", type=int, help="a shallower --shape, to check the script quickly (no figures)"
    )
    args = parser.parse_args()
    dtype_name = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    dtype = getattr(torch, dtype_name)
    words = vocabulary_words()
    path = args.model or build_shape(args.shape, dtype, words, args.layers)
    queries, documents = make_pairs(words, args.queries, args.pairs)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    options = {"device": args.device, "dtype": dtype_name}
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.device.startswith("cuda"):  # a KV cache for the run, not for 90% of the GPU
        budget = plan_deployment(EngineConfig.from_options(model=str(path), **options))
        options["kv_cache_tokens"] = 4 * budget.max_num_batched_tokens
    engine_s, peer_s, diff, tokens = measure(
        path, queries, documents, batch_sizes, args.rounds, options, dtype
    )
    n = len(queries)
    print(f"{path.name}: {n} pairs ({tokens / n:.0f} tokens per pair on average), {dtype_name}")
    print(f"torch {torch.__version__} on {args.device}")
    print(f"{'engine (Engine.score)':32s} {_rates(n, engine_s)}")
    for b in batch_sizes:
        print(f"{'CrossEncoder.predict B=' + str(b):32s} {_rates(n, peer_s[b])}")
    best_b = min(batch_sizes, key=lambda b: min(peer_s[b]))
    best = min(peer_s[best_b]) / min(engine_s)
    median = min(statistics.median(peer_s[b]) for b in batch_sizes) / statistics.median(engine_s)
    print(f"ratio engine / CrossEncoder.predict at its best B={best_b}: ", end="")
    print(f"{best:.2f}x (best runs), {median:.2f}x (median runs)")
    print(f"largest score difference, engine vs CrossEncoder: {diff:.2e}")


def measure(path, queries, documents, batch_sizes, rounds, options, dtype):
    from sentence_transformers import CrossEncoder

    pairs = list(zip(queries, documents, strict=True))
    peer = CrossEncoder(str(path), device=options["device"], model_kwargs={"dtype": dtype})
    with pipepool.Engine(str(path), **options) as engine:
        engine.score(queries, documents)  # warm-up: compilation, CUDA graphs of every size
        peer.predict(pairs[:256], batch_size=batch_sizes[0], show_progress_bar=False)
        tokens_before = engine.stats.prompt_tokens_finished
        engine_s, peer_s, diff = [], {b: [] for b in batch_sizes}, 0.0
        for _ in range(rounds):
            seconds, ours = timed(lambda: engine.score(queries, documents))
            engine_s.append(seconds)
            for b in batch_sizes:
                seconds, theirs = timed(
                    lambda b=b: peer.predict(pairs, batch_size=b, show_progress_bar=False)
                )
                peer_s[b].append(seconds)
                diff = max(diff, float(np.abs(ours - np.asarray(theirs, np.float32)).max()))
        tokens = (engine.stats.prompt_tokens_finished - tokens_before) // rounds
    return engine_s, peer_s, diff, tokens


def _rates(n: int, seconds: list[float]) -> str:
    runs = " ".join(f"{n / s:.0f}" for s in seconds)
    best, median = n / min(seconds), n / statistics.median(seconds)
    return f"best {best:8.0f}  median {median:8.0f} pairs/s  (runs: {runs})"


if __name__ == "__main__":
    main()
