"""Engine options shared by every subcommand; each flag can also come from ``PIPEPOOL_<FLAG>``
(e.g. ``PIPEPOOL_MAX_NUM_BATCHED_TOKENS=4096``), the command line winning."""

from __future__ import annotations

import argparse
import os
from dataclasses import fields

from ..config import EngineConfig


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
    """One flag per ``EngineConfig`` option offered on the command line (its metadata says
    how); ``skip`` names fields a command defines its own way (``parity`` takes lists of PP
    degrees, budgets and poolings). A flag left out keeps the config's own default."""
    g = parser.add_argument_group("engine")
    offered = [f for f in fields(EngineConfig) if f.metadata.get("cli") and f.name not in skip]
    parser.set_defaults(engine_options=tuple(f.name for f in offered))
    for f in offered:
        meta = f.metadata
        long = "--" + f.name.replace("_", "-")
        flags = [meta["flag"], long] if meta.get("flag") else [long]
        name = flags[0][2:]
        shown = f" (default: {f.default})" if f.default is not None else ""
        kwargs = {"dest": f.name, "help": meta["help"] + shown}
        if str(f.type).startswith("bool"):
            g.add_argument(
                *flags, action=argparse.BooleanOptionalAction, default=env_bool(name), **kwargs
            )
            continue
        if "parse" in meta:
            kwargs["type"] = meta["parse"]
        elif str(f.type).startswith("int"):
            kwargs["type"] = int
        elif str(f.type).startswith("float"):
            kwargs["type"] = float
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
        if "metavar" in meta:
            kwargs["metavar"] = meta["metavar"]
        g.add_argument(*flags, default=env(name), **kwargs)


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The EngineConfig the flags describe; ``overrides`` for what a command sets itself."""
    given = {
        name: getattr(args, name) for name in args.engine_options if getattr(args, name) is not None
    }
    return EngineConfig(**{**given, **overrides})
