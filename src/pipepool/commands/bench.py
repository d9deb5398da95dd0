"""``pipepool bench``: not built yet."""

from __future__ import annotations

import argparse


def add_parser(sub, help: str) -> None:
    sub.add_parser("bench", help=help, description=help)


def run(args: argparse.Namespace) -> int:
    raise SystemExit("pipepool bench is not implemented yet")
