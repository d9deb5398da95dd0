"""The command line's inputs read line for line: TEXT arguments, ``--input`` files (.txt,
.jsonl, .json) and stdin become one list of items, each knowing the argument or line it came
from.

A line ends at ``\\n`` or ``\\r\\n`` and nowhere else: form feeds, vertical tabs, U+2028,
U+2029, NEL and the \\x1c-\\x1e separators that ``str.splitlines()`` also splits on stay inside
their line, so line i of a file is what an editor, ``wc -l`` and ``sed -n ip`` call line i.
Lines are decoded as UTF-8 one by one, so a line that is not valid UTF-8 is named by its
number and can be stopped at, left out or read with U+FFFD replacements.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InvalidInputError

STDIN = "-"
# What ``errors`` may say about a line that is not valid UTF-8: stop at it (an error naming
# it), leave it out (counted), or read it with U+FFFD for each invalid byte sequence.
ERROR_MODES = ("stop", "skip", "replace")
_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark (Windows editors write one); not text


class UndecodableLineError(InvalidInputError):
    """A line is not valid UTF-8 and ``errors="stop"``; ``line`` is its 1-based number."""

    def __init__(self, message: str, *, line: int) -> None:
        super().__init__(message, param="input")
        self.line = line


@dataclass(frozen=True)
class Lines:
    """The lines of a file, in order, without their terminators.

    ``texts[i]`` is line ``numbers[i]`` (1-based, strictly increasing); a line left out as
    undecodable (``errors="skip"``) is in ``undecodable`` instead, so ``numbers`` and
    ``undecodable`` together are 1..n for a file of n lines. ``replaced`` lists the kept lines
    whose invalid bytes became U+FFFD (``errors="replace"``)."""

    texts: list[str]
    numbers: list[int]
    undecodable: list[int] = field(default_factory=list)
    replaced: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert len(self.texts) == len(self.numbers)


def split_lines(data: bytes, *, name: str, errors: str = "stop") -> Lines:
    """``data`` (a file's bytes) as lines: only ``\\n`` and ``\\r\\n`` end one, a last line
    without a terminator counts, a leading UTF-8 byte order mark is dropped. A file of n
    lines gives n entries (``texts`` plus ``undecodable``). ``errors`` as in ``ERROR_MODES``;
    "stop" raises ``UndecodableLineError`` naming ``name`` and the line."""
    _check_errors(errors)
    data = data.removeprefix(_BOM)
    if not data:
        return Lines([], [])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return _split_undecodable(data, name, errors)
    texts = text.split("\n")
    if text.endswith("\n"):
        texts.pop()  # a terminator ends its line; it does not start another
    texts = [t.removesuffix("\r") for t in texts]
    return Lines(texts, list(range(1, len(texts) + 1)))


def _split_undecodable(data: bytes, name: str, errors: str) -> Lines:
    """``split_lines`` for a file with invalid UTF-8: line by line. ``\\n`` is the byte 0x0A
    in UTF-8 and never part of a multi-byte sequence, so splitting bytes is splitting text."""
    raws = data.split(b"\n")
    if data.endswith(b"\n"):
        raws.pop()
    texts: list[str] = []
    numbers: list[int] = []
    undecodable: list[int] = []
    replaced: list[int] = []
    for n, raw in enumerate(raws, 1):
        raw = raw.removesuffix(b"\r")
        try:
            texts.append(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            if errors == "stop":
                column = len(raw[: exc.start].decode("utf-8")) + 1
                raise UndecodableLineError(
                    f"{name}:{n}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at character "
                    f"{column})",
                    line=n,
                ) from None
            if errors == "skip":
                undecodable.append(n)
                continue
            texts.append(raw.decode("utf-8", errors="replace"))
            replaced.append(n)
        numbers.append(n)
    return Lines(texts, numbers, undecodable, replaced)


def is_blank(text: str) -> bool:
    """A blank line: empty or only whitespace (spaces, tabs, form feeds, U+2028, ...)."""
    return not text.strip()


@dataclass
class Inputs:
    """What to embed, and where each item came from, for error messages and the row->line map.

    ``origins[i]`` names the source of ``items[i]`` ("in.txt:9", "TEXT argument 2", "in.json
    element 4"); ``lines[i]`` is its 1-based line in a line source (.txt, .jsonl, stdin), None
    for TEXT arguments and .json elements; ``sources[i]`` names its argument or file. The
    counters say what was left out or changed on the way."""

    items: list = field(default_factory=list)
    origins: list[str] = field(default_factory=list)
    lines: list[int | None] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    skipped_blank: int = 0  # blank lines left out (keep_blank=False)
    undecodable: list[str] = field(default_factory=list)  # origins of lines left out
    replaced: list[str] = field(default_factory=list)  # origins of lines read with U+FFFD

    def add(self, item: Any, origin: str, *, source: str, line: int | None = None) -> None:
        self.items.append(item)
        self.origins.append(origin)
        self.lines.append(line)
        self.sources.append(source)

    def line_map(self) -> list[int] | None:
        """The 1-based input line of every item, when all of them are lines of one file (or
        stdin); None otherwise (TEXT arguments, .json elements, several sources)."""
        if not self.items or len(set(self.sources)) != 1 or self.lines[0] is None:
            return None
        return [n for n in self.lines if n is not None]


def read_inputs(
    texts: list[str],
    path: str | Path | None,
    *,
    keep_blank: bool = False,
    errors: str = "stop",
) -> Inputs:
    """Inputs from TEXT arguments and ``--input`` (a file or ``-``), each with its origin,
    in that order. A blank line (``is_blank``) of a .txt, .jsonl or stdin is left out and
    counted, or with ``keep_blank`` kept as an item: its own text in a .txt or stdin, ""
    in a .jsonl. ``errors`` says what a line that is not valid UTF-8 does (``ERROR_MODES``).
    Raises InvalidInputError when there is nothing to embed or a source cannot be read."""
    _check_errors(errors)
    inputs = Inputs()
    sources = []
    for k, text in enumerate(texts, 1):
        if text == STDIN:
            sources.append(STDIN)
        else:
            inputs.add(text, f"TEXT argument {k}", source="TEXT arguments")
    if path is not None:
        sources.append(str(path))
    for source in sources:
        before, skipped = len(inputs.items), len(inputs.undecodable)
        _read_source(source, inputs, keep_blank, errors)
        if len(inputs.items) == before:
            name = "stdin" if source == STDIN else source
            left_out = len(inputs.undecodable) - skipped
            why = f"; {left_out} line(s) left out as not valid UTF-8" if left_out else ""
            raise InvalidInputError(
                f"{name} has nothing to embed (it is empty or has only blank lines{why})",
                param="input",
            )
    if not inputs.items:
        raise InvalidInputError(
            "nothing to embed: give TEXT arguments, --input FILE, or '-' to read stdin",
            param="input",
        )
    return inputs


def _check_errors(errors: str) -> None:
    if errors not in ERROR_MODES:
        raise InvalidInputError(f"errors must be one of {ERROR_MODES}, got {errors!r}")


def _read_source(source: str, inputs: Inputs, keep_blank: bool, errors: str) -> None:
    if source == STDIN:
        name, path, data = "<stdin>", None, _stdin_bytes()
    else:
        path = Path(source)
        name = str(path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise InvalidInputError(f"cannot read --input {path}: {exc}", param="input") from None
    if path is not None and path.suffix == ".json":
        _read_json_array(path, _decode_whole(data, name, errors), inputs)
        return
    lines = split_lines(data, name=name, errors=errors)
    inputs.undecodable += [f"{name}:{n}" for n in lines.undecodable]
    inputs.replaced += [f"{name}:{n}" for n in lines.replaced]
    jsonl = path is not None and path.suffix == ".jsonl"
    for n, line in zip(lines.numbers, lines.texts, strict=True):
        if is_blank(line):
            if not keep_blank:
                inputs.skipped_blank += 1
                continue
            item: Any = "" if jsonl else line  # a blank JSON line holds no value: an empty text
        else:
            item = _item(name, n, _parse(name, n, line)) if jsonl else line
        inputs.add(item, f"{name}:{n}", source=name, line=n)


def _stdin_bytes() -> bytes:
    """Stdin's bytes, decoded here like a file's; a text-only stream (a test's StringIO) is
    encoded back, its undecodable bytes (surrogate escapes) restored."""
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is not None:
        return buffer.read()
    return sys.stdin.read().encode("utf-8", errors="surrogateescape")


def _decode_whole(data: bytes, name: str, errors: str) -> str:
    """A .json file's text. Its elements are not lines, so an invalid byte cannot leave one
    line out: "skip" refuses the file like "stop", naming the line; "replace" reads U+FFFD."""
    data = data.removeprefix(_BOM)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if errors == "replace":
            return data.decode("utf-8", errors="replace")
        n = data.count(b"\n", 0, exc.start) + 1
        also = " (--errors skip leaves out lines of .txt and .jsonl files only)"
        raise UndecodableLineError(
            f"{name}:{n}: not valid UTF-8 (byte 0x{data[exc.start]:02x})"
            + (also if errors == "skip" else ""),
            line=n,
        ) from None


def _read_json_array(path: Path, text: str, inputs: Inputs) -> None:
    if not text.strip():
        return
    data = _parse(str(path), None, text)
    if not isinstance(data, list):
        raise InvalidInputError(
            f"{path}: expected a JSON array of texts, got {type(data).__name__}", param="input"
        )
    for k, obj in enumerate(data):
        origin = f"{path} element {k}"
        inputs.add(_item(str(path), f"element {k}", obj), origin, source=str(path))


def _parse(name: str, line: int | None, text: str) -> Any:
    """JSON of one line (``line``) or of a whole file (None: the error's own line)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        at = line if line is not None else exc.lineno  # json counts lines by "\n" only, too
        raise InvalidInputError(f"{name}:{at}: not valid JSON ({exc.msg})", param="input") from None


def _item(name: str, where: int | str, obj: Any) -> Any:
    if isinstance(obj, dict):
        obj = obj.get("text", obj.get("input"))
    if not isinstance(obj, (str, list)):
        sep = ":" if isinstance(where, int) else " "
        raise InvalidInputError(
            f"{name}{sep}{where}: expected a string, a token list or {{'text': ...}}",
            param="input",
        )
    return obj
