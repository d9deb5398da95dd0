"""An ``argparse`` parser that answers a misspelled flag or command with the closest known
ones ("did you mean --model?"), as git and cargo do: argparse of Python < 3.14 only says that
an argument is unrecognized."""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Iterator
from typing import NoReturn

_UNRECOGNIZED = "unrecognized arguments: "
_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)'")


class SuggestingParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors name the closest known flags or subcommands;
    its subparsers are of the same class (``add_subparsers`` makes them of the parent's)."""

    def error(self, message: str) -> NoReturn:
        hint = self._suggestion(message)
        super().error(f"{message}{hint}")

    def _suggestion(self, message: str) -> str:
        if message.startswith(_UNRECOGNIZED):
            known = sorted(set(_option_strings(self)))
            hints = []
            for arg in message.removeprefix(_UNRECOGNIZED).split():
                flag = arg.split("=", 1)[0]
                if not flag.startswith("-"):
                    continue
                close = difflib.get_close_matches(flag, known, n=3, cutoff=0.6)
                if close:
                    hints.append(f"{flag}: did you mean {' or '.join(close)}?")
            return "".join(f"\n  {h}" for h in hints)
        choice = _INVALID_CHOICE.search(message)
        if choice:
            choices = [c for a in self._actions if a.choices for c in a.choices]
            close = difflib.get_close_matches(choice[1], [str(c) for c in choices], n=3)
            if close:
                return f"\n  did you mean {' or '.join(close)}?"
        return ""


def _option_strings(parser: argparse.ArgumentParser) -> Iterator[str]:
    """Every flag of ``parser`` and of the subcommand parsers under it."""
    for action in parser._actions:
        yield from action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _option_strings(sub)
