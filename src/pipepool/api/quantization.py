"""Embeddings quantized to int8 | uint8 | binary | ubinary, by two rules: sentence-transformers'
``quantize_embeddings`` (buckets over per-dimension ranges), and ``quantize_symmetric`` (one
symmetric scale per model, ``api/int8_scale.py``). The one implementation behind
``SentenceTransformer.encode(precision=...)`` and the server's Cohere routes."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InvalidInputError

PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")
# The largest int8 magnitude of the symmetric rule: -127..127, so that -v gives -int8(v).
INT8_LEVELS = 127


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


def quantize_symmetric(embeddings: Any, precision: str, bound: float) -> np.ndarray:
    """int8 | uint8 of ``[n, dim]`` float vectors on one symmetric scale: int8 =
    ``round(127 * v / bound)`` (half to even), clipped to -127..127; uint8 = int8 + 128. Every
    dimension shares the scale, so an int8 vector is the float vector times ``127 / bound``,
    rounded: its dot products and cosines approximate the float ones. Each vector's integers
    depend on that vector and ``bound`` alone. ``bound``: a positive float
    (``int8_scale.symmetric_bound``); components beyond it are clipped."""
    if precision not in ("int8", "uint8"):
        raise InvalidInputError(
            f"the symmetric rule makes int8 or uint8; got {precision!r}", param="precision"
        )
    if not bound > 0:  # also refuses NaN
        raise ValueError(f"bound must be a positive number, got {bound!r}")
    scaled = np.asarray(embeddings, dtype=np.float64) * (INT8_LEVELS / bound)  # [n, dim]
    levels = np.clip(np.rint(scaled), -INT8_LEVELS, INT8_LEVELS)
    return (levels + 128).astype(np.uint8) if precision == "uint8" else levels.astype(np.int8)
