"""Embeddings quantized as sentence-transformers' ``quantize_embeddings`` makes them: the one
implementation behind ``Engine.encode(precision=...)`` and the server's ``/v2/embed``."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InvalidInputError

PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")


def quantize_embeddings(
    embeddings: Any,
    precision: str,
    ranges: np.ndarray | None = None,
    calibration_embeddings: np.ndarray | None = None,
) -> np.ndarray:
    """sentence-transformers' ``quantize_embeddings``, operation for operation, on ``[n, dim]``
    float vectors (an array, or anything ``np.asarray`` takes), to float32 | int8 | uint8 |
    binary | ubinary. int8/uint8 buckets span ``ranges`` (``[2, dim]``: each dimension's
    minimum, then maximum), else each dimension's range over ``calibration_embeddings``, else
    over the vectors themselves (what ``encode(precision=...)`` gives: the whole call's
    vectors); binary packs the signs (``v > 0``), 8 per byte, minus 128 for the signed form.
    Vectors computed by two implementations differ by float rounding, and a value that close
    to a bucket edge can land in the next bucket. Raises ``InvalidInputError`` for an unknown
    precision or a ``ranges`` of the wrong shape."""
    if precision not in PRECISIONS:
        raise InvalidInputError(
            f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}",
            param="precision",
        )
    embeddings = np.asarray(embeddings)  # [n, dim]
    if precision == "float32":
        return embeddings.astype(np.float32)
    if precision.endswith("int8"):
        if ranges is None:
            ranges_from = embeddings if calibration_embeddings is None else calibration_embeddings
            ranges = np.vstack((np.min(ranges_from, axis=0), np.max(ranges_from, axis=0)))
        ranges = np.asarray(ranges)  # [2, dim]: minimum, maximum
        if ranges.shape != (2, embeddings.shape[-1]):
            raise InvalidInputError(
                f"ranges must be [2, {embeddings.shape[-1]}] (each dimension's minimum, then "
                f"maximum); got shape {list(ranges.shape)}",
                param="ranges",
            )
        starts = ranges[0, :]
        steps = (ranges[1, :] - ranges[0, :]) / 255
        steps = np.where(steps == 0, 1, steps)
        buckets = np.clip(np.floor((embeddings - starts) / steps), 0, 255)
        return buckets.astype(np.uint8) if precision == "uint8" else (buckets - 128).astype(np.int8)
    packed = np.packbits(embeddings > 0, axis=-1).reshape(embeddings.shape[0], -1)
    return packed if precision == "ubinary" else (packed - 128).astype(np.int8)
