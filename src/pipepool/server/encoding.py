"""How vectors go on the wire, as vLLM sends them: JSON floats, base64 of their bytes, or the
bytes themselves as the whole body (``encoding_format`` "bytes" and "bytes_only"), each in
``embed_dtype`` and, for bytes, in ``endianness``.

vLLM's binary answer: the body is every output's bytes, one after the other (each row-major,
``embed_dtype``, ``endianness``), ``Content-Type: application/octet-stream``; with "bytes" a
``metadata`` header holds the rest of the answer as JSON: ``{"id", "created", "model",
"data": [{"index", "embed_dtype", "endianness", "start", "end", "shape"}], "usage"}``, where
``start``/``end`` are each output's byte range in the body; "bytes_only" sends no header."""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from fastapi import Response

from . import lock_blocks

EncodingFormat = Literal["float", "base64", "bytes", "bytes_only"]
EmbedDtype = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
Endianness = Literal["native", "big", "little"]
BINARY_FORMATS = ("bytes", "bytes_only")

# Types numpy lacks are rounded by torch (to nearest even), as vLLM rounds them, and sent as
# their bit patterns.
_TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
_BITS = {
    "float16": torch.int16,
    "bfloat16": torch.int16,
    "fp8_e4m3": torch.uint8,
    "fp8_e5m2": torch.uint8,
}


# A call's outputs: an [n, D] matrix (one vector per input, as the engine gives them), or one
# array per input (token outputs, scores).
Vectors = np.ndarray | Sequence[np.ndarray]


def values_in(vectors: Vectors) -> int:
    """How many numbers ``vectors`` hold (an answer's size): a matrix's without a view of each
    row."""
    if isinstance(vectors, np.ndarray):
        return vectors.size
    return sum(v.size for v in vectors)


@dataclass(frozen=True)
class Wire:
    """How a request asked for its vectors written: ``encoding_format``, ``embed_dtype`` and
    ``endianness`` (vLLM's meanings, module docstring)."""

    format: EncodingFormat = "float"
    dtype: EmbedDtype = "float32"
    endianness: Endianness = "native"

    @property
    def binary(self) -> bool:
        """Whether the vectors are the body itself (``binary_response``), not JSON."""
        return self.format in BINARY_FORMATS

    def json(self, array: np.ndarray) -> list | str:
        """``array`` as a JSON value: nested floats or a base64 string."""
        return encode_array(array, self.format, self.dtype, self.endianness)

    def json_rows(self, vectors: Vectors) -> list:
        """``json`` of each of ``vectors`` (``encode_rows``)."""
        return encode_rows(vectors, self.format, self.dtype, self.endianness)


def to_bytes(array: np.ndarray, embed_dtype: EmbedDtype, endianness: Endianness) -> bytes:
    """A float32 vector or matrix as bytes of ``embed_dtype``, row-major, in ``endianness``
    ("native": this server's, as vLLM reads it)."""
    bits = _bits(array, embed_dtype)
    return bits.astype(bits.dtype.newbyteorder(endianness), copy=False).tobytes()


def rounded(array: np.ndarray, embed_dtype: EmbedDtype) -> np.ndarray:
    """The values rounded through ``embed_dtype``, as float32 (the "float" format's values)."""
    if embed_dtype == "float32":
        return array
    narrow = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
    return narrow.to(_TORCH_DTYPES[embed_dtype]).float().numpy()


def encode_array(
    array: np.ndarray,
    encoding_format: str,
    embed_dtype: EmbedDtype = "float32",
    endianness: Endianness = "little",
) -> list | str:
    """A float32 vector (or matrix) as JSON, in ``embed_dtype``: nested floats (the values
    rounded through it), or base64 of its bytes in ``endianness``, row-major (little-endian
    unless asked: OpenAI's and Cohere's base64)."""
    if encoding_format == "base64":
        return base64.b64encode(to_bytes(array, embed_dtype, endianness)).decode("ascii")
    assert encoding_format == "float", f"{encoding_format} is not a JSON format"
    return rounded(array, embed_dtype).tolist()


def encode_rows(
    vectors: Vectors,
    encoding_format: str,
    embed_dtype: EmbedDtype = "float32",
    endianness: Endianness = "little",
) -> list:
    """``encode_array`` of each of ``vectors``, the same values and strings, where a matrix's
    float rows are float64 arrays that ``lock_blocks.dumps`` writes as their lists would be
    written; a matrix is converted in one go (rounding, byte order, widening, base64), not a
    row at a time: per row, Python's own work would cost more than the conversion itself for
    short vectors."""
    if not _is_matrix(vectors):
        return [encode_array(v, encoding_format, embed_dtype, endianness) for v in vectors]
    assert isinstance(vectors, np.ndarray)
    if encoding_format == "float":
        return lock_blocks.rows_as_arrays(rounded(vectors, embed_dtype))
    assert encoding_format == "base64", f"{encoding_format} is not a JSON format"
    data = to_bytes(vectors, embed_dtype, endianness)
    row = len(data) // len(vectors)
    if row % 3 == 0:
        # Whole 3-byte groups per row: the matrix's base64 is the rows' base64 back to back
        # (no row's last group borrows bytes of the next, so no padding falls inside).
        text = base64.b64encode(data).decode("ascii")
        width = row // 3 * 4
        return [text[lo : lo + width] for lo in range(0, len(text), width)]
    view = memoryview(data)
    rows = range(0, len(data), row)
    return [base64.b64encode(view[lo : lo + row]).decode("ascii") for lo in rows]


def binary_response(outputs: Vectors, wire: Wire, head: dict, num_tokens: list[int]) -> Response:
    """vLLM's binary answer (module docstring) of ``outputs``, in input order; ``head``: the
    answer's ``id``, ``created`` and ``model``, which "bytes" sends in its metadata header. A
    matrix is converted in one go (``encode_rows``)."""
    if _is_matrix(outputs):
        body = to_bytes(np.asarray(outputs), wire.dtype, wire.endianness)
        sizes = [len(body) // len(outputs)] * len(outputs)
    else:
        parts = [to_bytes(out, wire.dtype, wire.endianness) for out in outputs]
        body, sizes = b"".join(parts), [len(p) for p in parts]
    headers = None
    if wire.format == "bytes":
        items, offset = [], 0
        for i, (out, size) in enumerate(zip(outputs, sizes, strict=True)):
            items.append(
                {
                    "index": i,
                    "embed_dtype": wire.dtype,
                    "endianness": wire.endianness,
                    "start": offset,
                    "end": offset + size,
                    "shape": list(out.shape),
                }
            )
            offset += size
        tokens = int(sum(num_tokens))
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        headers = {"metadata": json.dumps({**head, "data": items, "usage": usage})}
    return Response(body, media_type="application/octet-stream", headers=headers)


def _is_matrix(vectors: Vectors) -> bool:
    """A non-empty [n, D] array with D > 0: rows of one size, convertible in one go."""
    return isinstance(vectors, np.ndarray) and vectors.ndim == 2 and vectors.size > 0


def _bits(array: np.ndarray, embed_dtype: EmbedDtype) -> np.ndarray:
    """The values' bit patterns in ``embed_dtype``, native byte order."""
    if embed_dtype == "float32":
        return np.ascontiguousarray(array, dtype=np.float32)
    narrow = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
    narrow = narrow.to(_TORCH_DTYPES[embed_dtype])
    return narrow.view(_BITS[embed_dtype]).numpy()
