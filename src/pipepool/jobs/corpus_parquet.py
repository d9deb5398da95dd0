"""A .parquet corpus: its id kind from the schema, and its rows read in batches, one row group
at a time (``ParquetRows``, the row source ``corpus_input.Corpus`` reads shards from)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InvalidInputError
from .corpus_rows import CorpusSpec, Entry, IdKind, RowError, id_kind_of

if TYPE_CHECKING:
    import pyarrow as pa

# Rows per pyarrow batch read from a .parquet file: bounds memory within a large row group.
_PARQUET_BATCH = 8192


def _parquet_file(path: Path):
    import pyarrow.lib
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pyarrow.lib.ArrowException, OSError) as exc:
        raise InvalidInputError(f"--input {path}: not a readable parquet file: {exc}") from None


def parquet_id_kind(spec: CorpusSpec) -> IdKind:
    """From the schema: no id column, row numbers; integer or string columns, their kind.
    A text column that is missing or not strings makes every row an error: refused."""
    import pyarrow as pa

    schema = _parquet_file(spec.path).schema_arrow
    names = ", ".join(schema.names)
    if spec.text_field not in schema.names:
        raise InvalidInputError(
            f"--input {spec.path} has no column {spec.text_field!r} (--text-field; it has: "
            f"{names})",
            param="text_field",
        )
    if not _is_string(schema.field(spec.text_field).type):
        raise InvalidInputError(
            f"--input {spec.path}: column {spec.text_field!r} is "
            f"{schema.field(spec.text_field).type}, not strings",
            param="text_field",
        )
    if spec.id_field not in schema.names:
        return "row"
    id_type = schema.field(spec.id_field).type
    if pa.types.is_dictionary(id_type):
        id_type = id_type.value_type
    if pa.types.is_integer(id_type):
        return "int64"
    if _is_string(id_type):
        return "string"
    raise InvalidInputError(
        f"--input {spec.path}: column {spec.id_field!r} is {id_type}; ids must be integers or "
        "strings",
        param="id_field",
    )


def _is_string(t: pa.DataType) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t))


class ParquetRows:
    """The rows of a .parquet file in batches of at most ``_PARQUET_BATCH`` rows, one row
    group open at a time; ``skip`` passes whole row groups over unread. pyarrow decodes a
    row group's column chunks as it reads them: memory is bounded by a shard and one row
    group, whatever the file's size."""

    def __init__(self, spec: CorpusSpec, id_kind: IdKind) -> None:
        self._spec = spec
        self._kind = id_kind
        self._file = _parquet_file(spec.path)
        meta = self._file.metadata
        self._group_rows = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        self._columns = [spec.text_field] + ([spec.id_field] if id_kind != "row" else [])
        self._next_group = 0
        self._batches: Iterator[pa.RecordBatch] = iter(())
        self._left = 0  # rows of the open row group not yet out of ``_batches``
        self._pending: pa.RecordBatch | None = None  # the rest of a batch cut by a shard's end
        self._row = 0

    def skip(self, n: int) -> int:
        done = 0
        while done < n:
            if (
                self._pending is None
                and self._left == 0
                and self._next_group < len(self._group_rows)
                and self._group_rows[self._next_group] <= n - done
            ):
                done += self._group_rows[self._next_group]
                self._next_group += 1
                continue
            batch = self._batch()
            if batch is None:
                break
            done += len(self._cut(batch, n - done))
        self._row += done
        return done

    def take(self, n: int) -> list[Entry]:
        out: list[Entry] = []
        while len(out) < n:
            batch = self._batch()
            if batch is None:
                break
            part = self._cut(batch, n - len(out))
            texts = part.column(self._spec.text_field).to_pylist()
            ids = part.column(self._spec.id_field).to_pylist() if self._kind != "row" else None
            for i, text in enumerate(texts):
                self._row += 1
                out.append(self._entry(self._row, text, ids[i] if ids is not None else None))
        return out

    def _entry(self, row: int, text: str | None, value: int | str | None) -> Entry:
        row_id: int | str = row
        if self._kind != "row":
            if value is None:
                return RowError(row, None, f"{self._spec.id_field!r} is null")
            if id_kind_of(value) is None:  # a uint64 above int64's range
                return RowError(row, None, f"{self._spec.id_field!r} {value} is outside int64")
            row_id = value
        if text is None:
            return RowError(row, row_id, f"{self._spec.text_field!r} is null")
        return (row, row_id, text)

    def _batch(self) -> pa.RecordBatch | None:
        """The next rows not yet handed out, or None after the last."""
        if self._pending is not None:
            batch, self._pending = self._pending, None
            return batch
        while self._left == 0:
            if self._next_group == len(self._group_rows):
                return None
            group = self._next_group
            self._next_group += 1
            self._left = self._group_rows[group]
            self._batches = iter(
                self._file.iter_batches(
                    batch_size=_PARQUET_BATCH, row_groups=[group], columns=self._columns
                )
            )
        batch = next(self._batches)
        self._left -= len(batch)
        return batch

    def _cut(self, batch: pa.RecordBatch, n: int) -> pa.RecordBatch:
        """The first ``n`` rows of ``batch``; the rest is handed out next."""
        if len(batch) > n:
            self._pending = batch.slice(n)
            return batch.slice(0, n)
        return batch

    def close(self) -> None:
        self._file.close()
