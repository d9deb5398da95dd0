"""``pipepool serve``: not built yet."""

from __future__ import annotations

import argparse


def add_parser(sub, help: str) -> None:
    sub.add_parser("serve", help=help, description=help)


def run(args: argparse.Namespace) -> int:
    raise SystemExit("pipepool serve is not implemented yet")
