"""``pipepool embed | serve | parity | bench``."""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import PipepoolError

# name -> module under pipepool.commands with add_parser(subparsers) and run(args) -> int.
# Imported lazily: `serve` needs the server extras, the others must not.
SUBCOMMANDS = {
    "embed": "embed embed texts or token ids and print or save the vectors",
    "serve": "serve an OpenAI-compatible embedding server",
    "parity": "parity check vectors against transformers or PP=1, per request",
    "bench": "bench measure throughput against Hugging Face transformers",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipepool", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, line in SUBCOMMANDS.items():
        module = importlib.import_module(f"pipepool.commands.{name}")
        module.add_parser(sub, help=line.split(" ", 1)[1])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module = importlib.import_module(f"pipepool.commands.{args.command}")
    try:
        return int(module.run(args) or 0)
    except PipepoolError as exc:
        print(f"pipepool {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"pipepool {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
