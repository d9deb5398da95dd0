"""Engine options shared by every subcommand; each flag can also come from ``PIPEPOOL_<FLAG>``
(e.g. ``PIPEPOOL_MAX_NUM_BATCHED_TOKENS=4096``), the command line winning."""

from __future__ import annotations

import argparse
import os

from ..config import EngineConfig, parse_partition


def _env(name: str, default=None):
    return os.environ.get("PIPEPOOL_" + name.upper().replace("-", "_"), default)


def _env_bool(name: str) -> bool | None:
    value = _env(name)
    if value is None:
        return None
    return value.strip().lower() in ("1", "true", "yes", "on")


def add_engine_args(parser: argparse.ArgumentParser, *, with_model: bool = True) -> None:
    g = parser.add_argument_group("engine")
    if with_model:
        g.add_argument(
            "--model",
            default=_env("model"),
            help="model folder or hub id (default: the bundled all-MiniLM-L6-v2)",
        )
    g.add_argument(
        "--dtype", default=_env("dtype", "auto"), choices=["auto", "float32", "bfloat16", "float16"]
    )
    g.add_argument("--device", default=_env("device", "auto"), help="auto | cpu | cuda")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=int(_env("max_num_batched_tokens", 16384)),
        help="token budget of one step (long prompts are chunked to fit)",
    )
    g.add_argument("--max-num-seqs", type=int, default=int(_env("max_num_seqs", 256)))
    g.add_argument(
        "--max-model-len",
        type=int,
        default=int(_env("max_model_len")) if _env("max_model_len") else None,
    )
    g.add_argument(
        "--pp",
        "--pipeline-parallel-size",
        dest="pp",
        type=int,
        default=int(_env("pp", _env("pipeline_parallel_size", 1))),
        help="pipeline stages (one process and, on GPU, one device each)",
    )
    g.add_argument(
        "--pp-partition", default=_env("pp_partition"), help="layers per stage, e.g. 10,18"
    )
    g.add_argument("--pooling", default=_env("pooling"), choices=["last", "mean", "cls"])
    norm = g.add_mutually_exclusive_group()
    norm.add_argument(
        "--normalize", dest="normalize", action="store_true", default=_env_bool("normalize")
    )
    norm.add_argument("--no-normalize", dest="normalize", action="store_false")
    g.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=int(_env("kv_cache_tokens")) if _env("kv_cache_tokens") else None,
    )
    g.add_argument(
        "--no-verify-state",
        dest="verify_state",
        action="store_false",
        default=not (_env_bool("no_verify_state") or False),
        help="skip the lockstep checks between stages (not recommended; for measuring their cost)",
    )
    g.add_argument(
        "--compile",
        dest="compile",
        action=argparse.BooleanOptionalAction,
        default=_env_bool("compile"),
        help="torch.compile the layers (default: on for CUDA)",
    )


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    fields = dict(
        model=getattr(args, "model", None),
        dtype=args.dtype,
        device=args.device,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        pipeline_parallel_size=args.pp,
        pp_partition=parse_partition(args.pp_partition),
        pooling=args.pooling,
        normalize=args.normalize,
        kv_cache_tokens=args.kv_cache_tokens,
        verify_state=args.verify_state,
        compile=args.compile,
    )
    fields.update(overrides)
    return EngineConfig(**fields)
