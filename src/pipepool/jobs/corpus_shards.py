"""A corpus job's shards: ``part-00000.parquet``, ... in the output folder, one per shard of
input rows, with ``errors-00000.jsonl`` next to a shard that has rows giving no vector.

A shard's parquet file has the columns ``id`` (int64 or string, as the corpus's ids) and
``embedding`` (fixed_size_list<float32>[dim]), one row per vector, in input order. Its errors
file (one JSON object a line: row, id, error) is written before it, both whole
(``corpus_files.atomic_write``): a shard whose parquet file exists is finished, errors
included, and a rerun skips it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .corpus_files import atomic_write
from .corpus_rows import IdKind, RowError

_SHARD = re.compile(r"^part-(\d{5,})\.parquet$")


def shard_path(folder: Path, index: int) -> Path:
    return folder / f"part-{index:05d}.parquet"


def errors_path(folder: Path, index: int) -> Path:
    return folder / f"errors-{index:05d}.jsonl"


def finished_shards(folder: Path) -> set[int]:
    """The indices of the shards whose parquet file is in ``folder``."""
    return {int(m.group(1)) for p in folder.iterdir() if (m := _SHARD.match(p.name))}


def write_shard(
    folder: Path,
    index: int,
    ids: Sequence[int | str],
    vectors: np.ndarray,
    errors: Sequence[RowError],
    id_kind: IdKind,
) -> None:
    """Shard ``index``'s errors file (or none, removing a stale one), then its parquet file:
    ``ids[i]`` with ``vectors[i]`` (``[n, dim]`` float32)."""
    table = shard_table(ids, vectors, id_kind)
    target = errors_path(folder, index)
    if errors:
        text = "".join(json.dumps(e.as_json(), ensure_ascii=False) + "\n" for e in errors)
        atomic_write(target, lambda f: f.write(text.encode("utf-8")))
    else:
        target.unlink(missing_ok=True)
    atomic_write(shard_path(folder, index), lambda f: pq.write_table(table, f))


def shard_table(ids: Sequence[int | str], vectors: np.ndarray, id_kind: IdKind) -> pa.Table:
    """The parquet table of a shard; ``vectors``: ``[len(ids), dim]``."""
    assert vectors.ndim == 2 and len(vectors) == len(ids), (vectors.shape, len(ids))
    dim = vectors.shape[1]
    flat = pa.array(np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1))
    return pa.table(
        {
            "id": pa.array(ids, type=pa.string() if id_kind == "string" else pa.int64()),
            "embedding": pa.FixedSizeListArray.from_arrays(flat, dim),
        }
    )


def read_shard(path: Path) -> tuple[list[int | str], np.ndarray]:
    """A shard's ids and its vectors (``[n, dim]`` float32)."""
    table = pq.read_table(path)
    column = table.column("embedding").combine_chunks()
    dim = column.type.list_size
    vectors = column.flatten().to_numpy(zero_copy_only=False).reshape(-1, dim)
    return table.column("id").to_pylist(), vectors


def shard_counts(folder: Path, index: int) -> tuple[int, int]:
    """(vectors, error rows) of a finished shard, from its files' metadata and lines."""
    vectors = pq.read_metadata(shard_path(folder, index)).num_rows
    try:
        with open(errors_path(folder, index), "rb") as f:
            errors = sum(1 for _ in f)
    except FileNotFoundError:
        errors = 0
    return vectors, errors
