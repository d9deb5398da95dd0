"""``pipepool batch-store``: check, back up or recover the Batch API's state directory
(``server/store_check.py``, ``server/store_admin.py``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .common import add_env_argument


def add_parser(sub, help: str) -> None:
    p = sub.add_parser("batch-store", help=help, description=help)
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser(
        "check", help="check the store as a server does at its start (exit 1 if it would refuse)"
    )
    backup = actions.add_parser(
        "backup",
        help="copy the store (records through SQLite's online backup, then the bodies they "
        "name) into DEST, while servers use it; DEST is a state directory to start from",
    )
    backup.add_argument("dest", type=Path, help="a new or empty directory")
    actions.add_parser(
        "recover",
        help="rebuild a store that `serve` refuses: the damaged database and the bodies no "
        "record names go to STATE_DIR/damaged-<time>/, a new database keeps every record still "
        "readable (stop the servers using it first)",
    )
    for action in actions.choices.values():
        add_env_argument(
            action,
            "--state-dir",
            help="the server's --state-dir (default: $XDG_DATA_HOME/pipepool, else "
            "~/.local/share/pipepool)",
        )


def run(args: argparse.Namespace) -> int:
    from ..server.settings import ServerSettings
    from ..server.store_admin import backup, recover
    from ..server.store_check import find_problems

    state_dir = ServerSettings(state_dir=args.state_dir).batch_state_dir
    if args.action == "check":
        problems = find_problems(state_dir)
        for problem in problems:
            print(problem.error(), file=sys.stderr)
        if not problems:
            print(f"{state_dir}: ok")
        return 1 if problems else 0
    if args.action == "backup":
        copied = backup(state_dir, args.dest)
        print(f"backed up {state_dir} to {args.dest}: the records and {copied} file bodies")
        return 0
    done = recover(state_dir)
    kept = ", ".join(f"{n} {table}" for table, n in done.records.items()) or "no records"
    print(f"recovered {state_dir}: kept {kept}; the damaged database and "
          f"{done.bodies_set_aside} bodies no record names are in {done.aside}")  # fmt: skip
    for table, why in done.unreadable.items():
        print(f"  {table}: not all rows could be read: {why}", file=sys.stderr)
    return 0
