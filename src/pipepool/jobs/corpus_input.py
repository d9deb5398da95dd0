"""A corpus read a shard at a time: the rows of a .jsonl, .parquet or .txt file, each an (id,
text) to embed or an error to record.

Rows are numbered from 1: row r is line r of a .txt or .jsonl file (what ``sed -n rp`` shows;
only ``\\n`` ends a line, a trailing ``\\r`` is dropped) and the r-th row of a .parquet file.
Shard k of size S holds rows k*S+1 .. (k+1)*S, so it is the same rows on every reading, and
every row of it is either embeddable or an error: a rerun can skip finished shards by number.
One shard's rows are in memory at a time; a skipped shard's lines are counted, not parsed,
and a .parquet row group wholly inside skipped shards is not read at all.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..errors import InvalidInputError
from ..intake.text_files import is_blank
from .corpus_parquet import ParquetRows, parquet_id_kind
from .corpus_rows import CorpusSpec, Entry, IdKind, RowError, id_kind_of

FORMATS = ("jsonl", "parquet", "txt")
_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class Shard:
    """Rows ``first_row`` .. ``first_row + num_rows - 1`` of a corpus: shard ``index``.

    ``rows``, ``ids``, ``texts``: the rows that may be embedded, in row order; ``errors``: the
    others, in row order. Unless ``skipped`` (a shard passed over: no row read), every row
    is in exactly one of the two."""

    index: int
    first_row: int
    num_rows: int
    rows: list[int]
    ids: list[int | str]
    texts: list[str]
    errors: list[RowError]
    skipped: bool = False

    def __post_init__(self) -> None:
        assert len(self.rows) == len(self.ids) == len(self.texts)
        if self.skipped:
            assert not self.rows and not self.errors
        else:
            assert len(self.rows) + len(self.errors) == self.num_rows


class _Rows(Protocol):
    def skip(self, n: int) -> int: ...  # pass over up to n rows; returns how many there were
    def take(self, n: int) -> list[Entry]: ...  # read up to n rows
    def close(self) -> None: ...


class Corpus:
    """A corpus file, checked for what can be known before reading it through: that it
    exists, its format, a .parquet file's columns. ``id_kind`` (``IdKind``): for .jsonl, the
    first object decides (no id field: row numbers; else the first integer or string id);
    a row whose id is not of that kind is an error row. Raises InvalidInputError for a corpus
    that cannot be read at all."""

    def __init__(self, spec: CorpusSpec) -> None:
        self.spec = spec
        path = spec.path
        if spec.format not in FORMATS:
            raise InvalidInputError(
                f"--input {path}: a corpus is a .jsonl, .parquet or .txt file", param="input"
            )
        if not path.is_file():
            raise InvalidInputError(f"--input {path}: no such file", param="input")
        self.id_kind: IdKind
        if spec.format == "txt":
            self.id_kind = "row"
        elif spec.format == "jsonl":
            self.id_kind = _jsonl_id_kind(path, spec.id_field)
        else:
            self.id_kind = parquet_id_kind(spec)

    @property
    def path(self) -> Path:
        return self.spec.path

    def shards(self, shard_size: int, skip: Container[int] = ()) -> Iterator[Shard]:
        """Every shard of ``shard_size`` rows in order, read; those in ``skip`` passed over
        (``Shard.skipped``). Ends after the last row: no empty shard."""
        assert shard_size > 0
        source = self._open()
        try:
            for index in itertools.count():
                first = index * shard_size + 1
                if index in skip:
                    n = source.skip(shard_size)
                    if n:
                        yield Shard(index, first, n, [], [], [], [], skipped=True)
                else:
                    entries = source.take(shard_size)
                    n = len(entries)
                    if n:
                        yield _shard(index, first, entries)
                if n < shard_size:
                    return
        finally:
            source.close()

    def _open(self) -> _Rows:
        spec = self.spec
        if spec.format == "txt":
            return _LineRows(spec.path, _txt_entry)
        if spec.format == "jsonl":
            kind = self.id_kind
            return _LineRows(spec.path, lambda row, raw: _jsonl_entry(row, raw, spec, kind))
        return ParquetRows(spec, self.id_kind)


def _shard(index: int, first: int, entries: list[Entry]) -> Shard:
    rows: list[int] = []
    ids: list[int | str] = []
    texts: list[str] = []
    errors: list[RowError] = []
    for entry in entries:
        if isinstance(entry, RowError):
            errors.append(entry)
        else:
            rows.append(entry[0])
            ids.append(entry[1])
            texts.append(entry[2])
    return Shard(index, first, len(entries), rows, ids, texts, errors)


class _LineRows:
    """The lines of a .txt or .jsonl file, each parsed by ``parse(row, line_bytes)``."""

    def __init__(self, path: Path, parse: Callable[[int, bytes], Entry]) -> None:
        self._file = open(path, "rb")  # noqa: SIM115 (closed by close(), as the protocol says)
        self._parse = parse
        self._row = 0

    def skip(self, n: int) -> int:
        count = sum(1 for _ in itertools.islice(self._file, n))  # bytes split at \n only
        self._row += count
        return count

    def take(self, n: int) -> list[Entry]:
        out = []
        for raw in itertools.islice(self._file, n):
            self._row += 1
            line = raw.removesuffix(b"\n").removesuffix(b"\r")
            if self._row == 1:
                line = line.removeprefix(_BOM)
            out.append(self._parse(self._row, line))
        return out

    def close(self) -> None:
        self._file.close()


def _undecodable(exc: UnicodeDecodeError, raw: bytes) -> str:
    column = len(raw[: exc.start].decode("utf-8", errors="replace")) + 1
    return f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {column})"


def _txt_entry(row: int, raw: bytes) -> Entry:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return RowError(row, row, _undecodable(exc, raw))
    if is_blank(text):  # a blank line is no record (docs/python-api.md, empty and blank inputs)
        return RowError(row, row, "a blank line, no text")
    return (row, row, text)


def _jsonl_entry(row: int, raw: bytes, spec: CorpusSpec, kind: IdKind) -> Entry:
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return RowError(row, None, _undecodable(exc, raw))
    except json.JSONDecodeError as exc:
        if not raw.strip():
            return RowError(row, None, "a blank line, not a JSON object")
        return RowError(row, None, f"not valid JSON ({exc.msg} at column {exc.colno})")
    if not isinstance(obj, dict):
        return RowError(row, None, f"expected a JSON object, got {_json_kind(obj)}")
    if kind == "row":
        row_id: int | str = row
    elif spec.id_field not in obj:
        return RowError(row, None, f"no {spec.id_field!r} field")
    else:
        value = obj[spec.id_field]
        if id_kind_of(value) != kind:
            want = "integers" if kind == "int64" else "strings"
            return RowError(
                row,
                None,
                f"{spec.id_field!r} is {_json_kind(value)}; this corpus's ids are {want} "
                "(as in its first row)",
            )
        row_id = value
    if spec.text_field not in obj:
        return RowError(row, row_id, f"no {spec.text_field!r} field")
    text = obj[spec.text_field]
    if not isinstance(text, str):
        return RowError(row, row_id, f"{spec.text_field!r} is {_json_kind(text)}, not a string")
    return (row, row_id, text)


def _json_kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer" if id_kind_of(value) else "an integer outside int64"
    return {
        str: "a string",
        float: "a number",
        list: "an array",
        dict: "an object",
    }.get(type(value), type(value).__name__)


def _jsonl_id_kind(path: Path, id_field: str) -> IdKind:
    """The first JSON object decides: without ``id_field``, row numbers are the ids; with
    it, the first id that is an integer or a string gives the kind of all."""
    seen_object = False
    with open(path, "rb") as f:
        for raw in f:
            try:
                obj = json.loads(raw.removeprefix(_BOM))
            except ValueError:  # invalid JSON or UTF-8: an error row, decided elsewhere
                continue
            if not isinstance(obj, dict):
                continue
            if not seen_object and id_field not in obj:
                return "row"
            seen_object = True
            kind = id_kind_of(obj.get(id_field))
            if kind is not None:
                return kind
    return "row"
