"""Engine options shared by every subcommand, and the environment variable behind every flag.

Each flag can also come from ``PIPEPOOL_<FLAG>``, named after its first long form
(``--max-num-batched-tokens``: ``PIPEPOOL_MAX_NUM_BATCHED_TOKENS``; ``--pp``: ``PIPEPOOL_PP``),
the command line winning. A variable is parsed by its flag's own parser (type and choices) when
the command's arguments are: a bad value is an argparse error (exit 2) naming the variable and
what it accepts, raised by the command that reads it alone. A boolean is one of
``BOOLEAN_WORDS``; anything else, an empty value too, is refused rather than read as "off".
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import fields

from ..config import EngineConfig

BOOLEAN_WORDS = {
    "true": True, "1": True, "yes": True, "on": True,
    "false": False, "0": False, "no": False, "off": False,
}  # fmt: skip
_BOOLEANS_ACCEPTED = "true, false, 1, 0, yes, no, on or off (any case)"


def env_name(flag: str) -> str:
    """``--max-num-batched-tokens`` -> ``PIPEPOOL_MAX_NUM_BATCHED_TOKENS``."""
    return "PIPEPOOL_" + flag.lstrip("-").upper().replace("-", "_")


def parse_bool(text: str) -> bool:
    """One of ``BOOLEAN_WORDS``, in any case."""
    try:
        return BOOLEAN_WORDS[text.strip().lower()]
    except KeyError:
        raise ValueError(f"not a boolean: {text!r}") from None


class _FromEnvironment(str):
    """A flag's default as its ``PIPEPOOL_<FLAG>`` gave it. argparse parses a string default
    with the flag's ``type`` once the command line is read (when the flag was not given);
    the type knows this text from a command-line one by its class, so that its error names
    the variable and it checks the flag's choices (argparse checks a default against none)."""


def add_env_argument(group, *flags: str, default=None, **kwargs) -> argparse.Action:
    """``group.add_argument(*flags, default=default, **kwargs)``, its default taken from
    ``PIPEPOOL_<FLAG>`` when that is set and parsed strictly, as the flag is: by ``type`` and
    ``choices``, or as a boolean for ``action=BooleanOptionalAction``. The help names the
    variable."""
    variable = env_name(flags[0])
    boolean = kwargs.get("action") is argparse.BooleanOptionalAction
    parse = parse_bool if boolean else kwargs.pop("type", str)
    text = os.environ.get(variable)
    if text is not None:
        default = _FromEnvironment(text)
    help = kwargs.pop("help", None)
    action = group.add_argument(*flags, default=default, **kwargs)
    # Set after the action is made: BooleanOptionalAction takes no type from Python 3.12 on,
    # and its help would show the variable's raw text as its default.
    action.type = _strict(parse, variable, kwargs.get("choices"))
    action.help = f"{help} [env: {variable}]" if help else f"[env: {variable}]"
    return action


def _strict(parse: Callable, variable: str, choices) -> Callable[[str], object]:
    """``parse`` for a command-line value (argparse reports its errors and checks choices);
    for the variable's text, ``parse`` and the choices with errors that name the variable."""

    def convert(text: str):
        if not isinstance(text, _FromEnvironment):
            return parse(text)
        accepted = _accepted(parse, choices)
        if not text.strip():
            raise argparse.ArgumentTypeError(
                f"{variable} is set but empty: expected {accepted} (or unset it)"
            )
        try:
            value = parse(str(text))
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            detail = f"expected {accepted}" if parse in _DESCRIBED else str(exc)
            raise argparse.ArgumentTypeError(f"{variable}={str(text)!r}: {detail}") from None
        if choices is not None and value not in choices:
            raise argparse.ArgumentTypeError(f"{variable}={str(text)!r}: expected {accepted}")
        return value

    # argparse names a command-line value's type by __name__ ("invalid int value: 'x'").
    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


_DESCRIBED: dict[Callable, str] = {
    parse_bool: _BOOLEANS_ACCEPTED,
    int: "an integer",
    float: "a number",
    str: "a value",
}


def _accepted(parse: Callable, choices) -> str:
    if choices is not None:
        return "one of " + ", ".join(map(str, choices))
    return _DESCRIBED.get(parse, "a value its flag accepts")


def add_engine_args(
    parser: argparse.ArgumentParser,
    *,
    skip: tuple[str, ...] = (),
    own_defaults: dict[str, str] | None = None,
) -> None:
    """One flag per ``EngineConfig`` option offered on the command line (its metadata says
    how); ``skip`` names fields a command defines its own way (``parity`` takes lists of PP
    degrees, budgets and poolings), ``own_defaults`` the default a command chooses itself
    for an option, as its help should say it. A flag left out keeps the config's own
    default."""
    g = parser.add_argument_group("engine")
    offered = [f for f in fields(EngineConfig) if f.metadata.get("cli") and f.name not in skip]
    parser.set_defaults(engine_options=tuple(f.name for f in offered))
    for f in offered:
        meta = f.metadata
        long = "--" + f.name.replace("_", "-")
        flags = [meta["flag"], long] if meta.get("flag") else [long]
        shown = (own_defaults or {}).get(f.name, f.default)
        help = meta["help"] + (f" (default: {shown})" if shown is not None else "")
        kwargs: dict = {"dest": f.name, "help": help}
        if str(f.type).startswith("bool"):
            add_env_argument(g, *flags, action=argparse.BooleanOptionalAction, **kwargs)
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
        add_env_argument(g, *flags, **kwargs)


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The EngineConfig the flags describe; ``overrides`` for what a command sets itself."""
    given = {
        name: getattr(args, name) for name in args.engine_options if getattr(args, name) is not None
    }
    return EngineConfig(**{**given, **overrides})
