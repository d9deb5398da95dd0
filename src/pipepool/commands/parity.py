"""``pipepool parity``: every PP degree x token budget x pooling against a reference, per
request; prints a table (and writes JSON), exits 1 when any configuration falls below the
cosine threshold."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..config import POOLING_TYPES
from ..parity import DEFAULT_BUDGETS, DEFAULT_PPS, REFERENCES, Sweep, run_parity
from ..parity.settings import DEFAULT_POOLINGS
from .common import add_engine_args, engine_config
from .embed import read_inputs


def add_parser(sub, help: str) -> None:
    p = sub.add_parser(
        "parity",
        help=help,
        description=help,
        epilog="Without --prompts: the five prompts of the published PP reproducer plus "
        "prompts of mixed lengths up to max_model_len (pass --max-model-len to cap them). "
        "Classifiers (cross-encoders, rerankers) are compared per pair of a built-in query with "
        "each prompt, on raw logits (sentence-transformers' CrossEncoder or transformers). "
        "Vision-language models are compared on texts, built-in images and texts with images "
        "(ColQwen2 / ColPali: queries, pages and every query-page MaxSim).",
    )
    p.add_argument(
        "--pp",
        type=_int_list,
        metavar="LIST",
        default=None,
        help=f"pipeline degrees to try, comma-separated (default: {_join(DEFAULT_PPS)}; on CUDA "
        "those that the visible GPUs allow)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=_int_list,
        default=DEFAULT_BUDGETS,
        metavar="BUDGETS",
        help=f"token budgets to try, comma-separated (default: {_join(DEFAULT_BUDGETS)})",
    )
    p.add_argument(
        "--pooling",
        type=_pooling_list,
        metavar="LIST",
        default=None,
        help=f"poolings to compare, comma-separated (default: {_join(DEFAULT_POOLINGS)}; "
        "classifiers, dual encoders and page retrievers pool as their checkpoints say and take "
        "none)",
    )
    p.add_argument(
        "--reference-device",
        help="run the transformers reference here (default: the engine's device)",
    )
    p.add_argument(
        "--reference-dtype",
        choices=["float32", "bfloat16", "float16"],
        help="and in this dtype (default: the engine's), e.g. float32 for bf16 engines",
    )
    p.add_argument(
        "--reference",
        choices=REFERENCES,
        default="transformers",
        help="transformers: Hugging Face transformers / sentence-transformers on the same "
        "weights (fp32 on CPU, the chosen dtype on GPU); pp1: this engine with one stage and "
        "no chunking",
    )
    p.add_argument(
        "--prompts",
        type=Path,
        metavar="FILE",
        help=".txt (one prompt per line) or .jsonl; default: the built-in set",
    )
    p.add_argument(
        "--min-cosine",
        type=float,
        metavar="X",
        help="pass threshold per request (default: 0.99999 for float32; a 16-bit engine "
        "against a float32 transformers reference: 1 - cos within 1.5x transformers' own "
        "16-bit error + 1e-5, docs/design.md's bar; else 0.999 for 16-bit; int8, against float32: "
        "a fixed floor of 0.98)",
    )
    p.add_argument(
        "--max-score-diff",
        type=float,
        metavar="X",
        help="classifiers: pass threshold per pair's raw logit; page retrievers (ColQwen2, "
        "ColPali): per query-page MaxSim (default: 1e-4 for float32, 5e-2 for 16-bit; a 16-bit "
        "engine against a float32 transformers reference: 1.5x transformers' own largest "
        "16-bit error + 1e-5)",
    )
    p.add_argument("--json", type=Path, metavar="OUT", help="also write the report as JSON")
    add_engine_args(
        p, skip=("pipeline_parallel_size", "max_num_batched_tokens", "pooling", "trace")
    )


def run(args: argparse.Namespace) -> int:
    # The swept settings (lists here) are set per configuration by run_parity.
    base = engine_config(
        args,
        pipeline_parallel_size=1,
        max_num_batched_tokens=max(args.max_num_batched_tokens),
        pooling=None,
    )
    sweep = Sweep(
        pps=args.pp or _default_pps(args.device),
        budgets=args.max_num_batched_tokens,
        poolings=args.pooling,
        reference=args.reference,
        min_cosine=args.min_cosine,
        reference_device=args.reference_device,
        reference_dtype=args.reference_dtype,
        max_score_diff=args.max_score_diff,
    )
    prompts = read_inputs([], args.prompts).items if args.prompts is not None else None
    report = run_parity(base, sweep, prompts)
    print(report.header())
    print()
    print(report.table())
    print()
    print(report.summary())
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0 if report.passed else 1


def _default_pps(device: str) -> tuple[int, ...]:
    """DEFAULT_PPS, less the degrees that need more GPUs than are visible (on CPU, all)."""
    if device == "cpu":  # None, like "auto": whatever torch sees
        return DEFAULT_PPS
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return DEFAULT_PPS if gpus == 0 else tuple(pp for pp in DEFAULT_PPS if pp <= gpus)


def _join(values) -> str:
    return ",".join(map(str, values))


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"values must be >= 1, got {text!r}")
    return values


def _pooling_list(text: str) -> tuple[str, ...]:
    values = tuple(part.strip() for part in text.split(","))
    unknown = [v for v in values if v not in POOLING_TYPES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown pooling {unknown[0]!r}; choose from {', '.join(POOLING_TYPES)}"
        )
    return values
