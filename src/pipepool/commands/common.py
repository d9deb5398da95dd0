"""Engine options shared by every subcommand; each flag can also come from ``PIPEPOOL_<FLAG>``
(e.g. ``PIPEPOOL_MAX_NUM_BATCHED_TOKENS=4096``), the command line winning."""

from __future__ import annotations

import argparse
import os

from ..config import EngineConfig, parse_partition


def env(name: str, default=None):
    """``PIPEPOOL_<NAME>`` from the environment: the default of a flag."""
    return os.environ.get("PIPEPOOL_" + name.upper().replace("-", "_"), default)


def env_bool(name: str, default: bool | None = None) -> bool | None:
    """A yes/no ``PIPEPOOL_<NAME>``; ``default`` when it is not set."""
    value = env(name)
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def add_engine_args(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    """The engine flags; ``skip`` names (dest) that a command defines its own way (``parity``
    takes lists of PP degrees, budgets and poolings)."""
    g = parser.add_argument_group("engine")
    if "model" not in skip:
        g.add_argument(
            "--model",
            default=env("model"),
            help="model folder or hub id (default: the bundled all-MiniLM-L6-v2)",
        )
    g.add_argument(
        "--dtype", default=env("dtype", "auto"), choices=["auto", "float32", "bfloat16", "float16"]
    )
    g.add_argument("--device", default=env("device", "auto"), help="auto | cpu | cuda")
    if "max_num_batched_tokens" not in skip:
        g.add_argument(
            "--max-num-batched-tokens",
            type=int,
            default=int(env("max_num_batched_tokens", 16384)),
            help="token budget of one step (long prompts are chunked to fit)",
        )
    g.add_argument("--max-num-seqs", type=int, default=int(env("max_num_seqs", 256)))
    g.add_argument(
        "--max-model-len",
        type=int,
        default=int(env("max_model_len")) if env("max_model_len") else None,
    )
    if "pp" not in skip:
        g.add_argument(
            "--pp",
            "--pipeline-parallel-size",
            dest="pp",
            type=int,
            default=int(env("pp", env("pipeline_parallel_size", 1))),
            help="pipeline stages (one process and, on GPU, one device each)",
        )
    g.add_argument(
        "--pp-partition", default=env("pp_partition"), help="layers per stage, e.g. 10,18"
    )
    if "pooling" not in skip:
        g.add_argument("--pooling", default=env("pooling"), choices=["last", "mean", "cls"])
    norm = g.add_mutually_exclusive_group()
    norm.add_argument(
        "--normalize", dest="normalize", action="store_true", default=env_bool("normalize")
    )
    norm.add_argument("--no-normalize", dest="normalize", action="store_false")
    g.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=int(env("kv_cache_tokens")) if env("kv_cache_tokens") else None,
    )
    g.add_argument(
        "--no-verify-state",
        dest="verify_state",
        action="store_false",
        default=not (env_bool("no_verify_state") or False),
        help="skip the lockstep checks between stages (not recommended; for measuring their cost)",
    )
    g.add_argument(
        "--compile",
        dest="compile",
        action=argparse.BooleanOptionalAction,
        default=env_bool("compile"),
        help="torch.compile the layers (default: on for CUDA)",
    )


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The EngineConfig the flags describe; ``overrides`` for what a command sets itself."""
    fields = dict(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        pp_partition=parse_partition(args.pp_partition),
        normalize=args.normalize,
        kv_cache_tokens=args.kv_cache_tokens,
        verify_state=args.verify_state,
        compile=args.compile,
    )
    for flag, field in (
        ("max_num_batched_tokens", "max_num_batched_tokens"),
        ("pp", "pipeline_parallel_size"),
        ("pooling", "pooling"),
    ):
        if hasattr(args, flag):  # not skipped by the command
            fields[field] = getattr(args, flag)
    fields.update(overrides)
    return EngineConfig(**fields)
