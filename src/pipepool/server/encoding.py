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
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from fastapi import Response

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


def binary_response(
    outputs: list[np.ndarray], wire: Wire, head: dict, num_tokens: list[int]
) -> Response:
    """vLLM's binary answer (module docstring) of ``outputs``, in input order; ``head``: the
    answer's ``id``, ``created`` and ``model``, which "bytes" sends in its metadata header."""
    parts, items, offset = [], [], 0
    for i, out in enumerate(outputs):
        data = to_bytes(out, wire.dtype, wire.endianness)
        parts.append(data)
        items.append(
            {
                "index": i,
                "embed_dtype": wire.dtype,
                "endianness": wire.endianness,
                "start": offset,
                "end": offset + len(data),
                "shape": list(out.shape),
            }
        )
        offset += len(data)
    headers = None
    if wire.format == "bytes":
        tokens = int(sum(num_tokens))
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        headers = {"metadata": json.dumps({**head, "data": items, "usage": usage})}
    return Response(b"".join(parts), media_type="application/octet-stream", headers=headers)


def _bits(array: np.ndarray, embed_dtype: EmbedDtype) -> np.ndarray:
    """The values' bit patterns in ``embed_dtype``, native byte order."""
    if embed_dtype == "float32":
        return np.ascontiguousarray(array, dtype=np.float32)
    narrow = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
    narrow = narrow.to(_TORCH_DTYPES[embed_dtype])
    return narrow.view(_BITS[embed_dtype]).numpy()
