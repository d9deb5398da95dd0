"""Ray Data batches as Arrow tables: the text (or image) columns an ``EmbedBatches`` reads, a
row named for an error message, and the columns it adds, in the types Ray Data gives tensors.

Every batch format Ray Data hands a UDF ("numpy": a dict of arrays, "pandas", "pyarrow") becomes
an Arrow table here, and a call returns that table with the output columns appended. Ray Data
stores blocks as Arrow anyway; building the output columns in Arrow fixes their types, so that a
dataset has one schema whatever ``batch_format`` was asked for and whichever rows a batch holds.
(Ray's inference from numpy would make equal-length token vectors a fixed-shape tensor in one
batch and a ragged one in the next, and cannot type the vectors of an empty batch.)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
from ray.data.block import BlockAccessor
from ray.data.extensions import (
    ArrowTensorArray,
    ArrowTensorType,
    ArrowTensorTypeV2,
    ArrowVariableShapedTensorArray,
    ArrowVariableShapedTensorType,
)

from ..errors import InvalidInputError

# Ray's tensor columns (``ray.data.read_images``' "image"; V2: the fixed-shape type Ray 2.60
# makes, not a subclass of the first).
_TENSOR_TYPES = (ArrowTensorType, ArrowTensorTypeV2, ArrowVariableShapedTensorType)
# How much of a row an error message shows besides its position: short scalar values (an id, a
# file name), the first few columns.
_SHOWN_COLUMNS = 4
_SHOWN_CHARS = 60


def as_table(batch: object) -> pa.Table:
    """The batch as an Arrow table, its columns and rows in the batch's order."""
    if isinstance(batch, pa.Table):
        return batch
    if isinstance(batch, dict):
        # Ray's own conversion of a returned dict, so columns read back as Ray would store them.
        batch = BlockAccessor.batch_to_block(batch)
    return BlockAccessor.for_block(batch).to_arrow()  # pandas; a TypeError names anything else


def texts_of(table: pa.Table, column: str) -> list[str]:
    """The strings of ``column``; InvalidInputError naming the first row that holds anything else
    (a None, a number), or the batch's columns where there is no such column."""
    if column not in table.column_names:
        raise InvalidInputError(
            f"the batch has no column {column!r}; its columns are "
            f"{', '.join(map(repr, table.column_names))}",
            param=column,
        )
    texts = table.column(column).to_pylist()
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InvalidInputError(
                f"{describe_row(table, i, skip=column)}: column {column!r} holds {text!r}, "
                "not a string",
                param=column,
                index=i,
            )
    return texts


def describe_row(table: pa.Table, index: int, *, skip: str = "") -> str:
    """``"row 17 of the batch (id=1234)"``: the row's position, which Ray Data's cut of the
    dataset into batches makes meaningless on its own, and its short scalar values, which let a
    user find it (long strings, such as texts, and vectors are left out)."""
    shown: list[str] = []
    for name in table.column_names:
        if name == skip or len(shown) == _SHOWN_COLUMNS:
            continue
        try:
            value = table.column(name)[index].as_py()
        except Exception:  # an extension type (a tensor) Arrow cannot turn into Python
            continue
        if isinstance(value, (bool, int, float, str)) and len(repr(value)) <= _SHOWN_CHARS:
            shown.append(f"{name}={value!r}")
    where = f" ({', '.join(shown)})" if shown else ""
    return f"row {index} of the batch{where}"


def vectors_column(vectors: np.ndarray) -> pa.Array:
    """``[n, dim]`` rows as Ray's fixed-shape tensor column (read back as one ``[n, dim]``
    array)."""
    assert vectors.ndim == 2, "one vector per row"
    return ArrowTensorArray.from_numpy(np.ascontiguousarray(vectors, dtype=np.float32))


def ragged_column(arrays: Sequence[np.ndarray]) -> pa.Array:
    """One ``[tokens, dim]`` float32 array per row as Ray's variable-shaped tensor column, also
    where every row has the same number of tokens (read back as an object array of arrays)."""
    if not arrays:
        kind = ArrowVariableShapedTensorType(pa.float32(), 2)
        return pa.ExtensionArray.from_storage(kind, pa.array([], type=kind.storage_type))
    rows = [np.ascontiguousarray(a, dtype=np.float32) for a in arrays]
    assert all(r.ndim == 2 for r in rows), "one [tokens, dim] array per row"
    return ArrowVariableShapedTensorArray.from_numpy(rows)


def list_column(rows: Sequence[np.ndarray], kind: pa.DataType) -> pa.Array:
    """One 1-D array per row as an Arrow ``list<kind>`` column (parquet's own list type, which
    other tools read). 32-bit offsets: a batch holds far fewer than 2**31 entries (4096 SPLADE
    vectors of a 30522-token vocabulary, every entry non-zero, are 125 M)."""
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    flat = np.concatenate(rows) if rows else np.empty(0)
    values = pa.array(flat.astype(kind.to_pandas_dtype(), copy=False), type=kind)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values)


def images_of(table: pa.Table, column: str, folder: str | None) -> list:
    """The images of ``column``: a binary value is an image's bytes (PNG, JPEG, ...), a string
    a file's path, relative ones under ``folder`` (the engine's allowed_local_media_path, which
    every file must lie under), a tensor (``ray.data.read_images``' column) an image's uint8
    pixels, ``[H, W]`` or ``[H, W, C]`` with C 1, 3 or 4; InvalidInputError naming the first
    row that holds anything else, or the batch's columns where there is no such column."""
    if column not in table.column_names:
        raise InvalidInputError(
            f"the batch has no column {column!r}; its columns are "
            f"{', '.join(map(repr, table.column_names))}",
            param=column,
        )
    kind = table.schema.field(column).type
    if isinstance(kind, _TENSOR_TYPES):
        arrays = BlockAccessor.for_block(table.select([column])).to_batch_format("numpy")[column]
        return [_pixels_image(table, column, i, np.asarray(a)) for i, a in enumerate(arrays)]
    images: list[bytes | Path] = []
    for i, value in enumerate(table.column(column).to_pylist()):
        if isinstance(value, (bytes, bytearray)):
            images.append(bytes(value))
        elif isinstance(value, str) and value:
            path = Path(value)
            images.append(path if path.is_absolute() or folder is None else Path(folder) / path)
        else:
            shown = f"{value!r}" if not isinstance(value, str) else "an empty string"
            raise InvalidInputError(
                f"{describe_row(table, i, skip=column)}: column {column!r} holds {shown[:80]}, "
                "not an image (its bytes, or a file's path)",
                param=column,
                index=i,
            )
    return images


def _pixels_image(table: pa.Table, column: str, index: int, pixels: np.ndarray):
    """A row's uint8 pixels as a PIL image (its mode from its channels)."""
    from PIL import Image

    channels = 1 if pixels.ndim == 2 else pixels.shape[-1] if pixels.ndim == 3 else 0
    if pixels.dtype != np.uint8 or channels not in (1, 3, 4):
        raise InvalidInputError(
            f"{describe_row(table, index, skip=column)}: column {column!r} holds a "
            f"{pixels.dtype} tensor of shape {pixels.shape}, not an image's uint8 pixels "
            "([H, W] or [H, W, C], C 1, 3 or 4)",
            param=column,
            index=index,
        )
    return Image.fromarray(pixels[..., 0] if pixels.ndim == 3 and channels == 1 else pixels)
