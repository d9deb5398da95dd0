"""The end of ``SentenceTransformer.encode``: vectors cut to ``truncate_dim``, quantized by the
rule the call chose (``ranges``), and handed back in the container sentence-transformers
returns."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InvalidInputError
from .quantization import quantize_embeddings, quantize_symmetric

if TYPE_CHECKING:
    from .engine import Engine
    from .int8_scale import Int8Calibration

# encode's int8/uint8 rules by name (a [2, dim] array of ranges is the third way).
RANGES = ("model", "call")
# A matrix quantized, given the whole call's values (which the "call" rule spans).
Quantize = Callable[[np.ndarray, np.ndarray], np.ndarray]


def cut(vectors: torch.Tensor, dim: int | None, normalize: bool) -> torch.Tensor:
    """``[n, dim]`` vectors cut to their first ``dim`` components, then normalised if asked."""
    vectors = vectors[..., :dim]
    return F.normalize(vectors, p=2, dim=1) if normalize else vectors


def check_ranges(ranges: Any, precision: str) -> None:
    """``encode``'s ``ranges``: ``"model"``, ``"call"`` or a ``[2, dim]`` array; the last two
    for int8/uint8 only (the other precisions have no buckets to place)."""
    if isinstance(ranges, str):
        if ranges not in RANGES:
            raise InvalidInputError(
                f"ranges must be 'model', 'call' or a [2, dim] array; got {ranges!r}",
                param="ranges",
            )
        if ranges == "model":
            return
    elif ranges is None or isinstance(ranges, (bool, int, float)):
        raise InvalidInputError(
            f"ranges must be 'model', 'call' or a [2, dim] array; got {ranges!r}", param="ranges"
        )
    if not precision.endswith("int8"):
        raise InvalidInputError(
            f"ranges places int8/uint8 buckets; precision {precision!r} has none", param="ranges"
        )


def quantizer(
    engine: Engine, calibration: Int8Calibration, precision: str, ranges: Any, kind: tuple
) -> Quantize:
    """How ``encode`` quantizes its matrices (``check_ranges`` passed). ``kind``: ``(pooling,
    normalize, tokens, dim, normalize_embeddings)``, the options that shaped the vectors; the
    model's bound for them (``"model"``) is computed on first use, from the calibration texts
    through the same options (``int8_scale``)."""
    if not precision.endswith("int8") or (isinstance(ranges, str) and ranges == "call"):
        return lambda matrix, whole: quantize_embeddings(matrix, precision, None, whole)
    if not isinstance(ranges, str):
        given = np.asarray(ranges)
        return lambda matrix, _: quantize_embeddings(matrix, precision, given)
    pooling, normalize, tokens, dim, normalize_embeddings = kind

    def calibrate(texts: list[str]) -> Any:
        computed = engine.submit(
            texts, pooling=pooling, normalize=normalize, long_inputs="truncate"
        ).result()
        if tokens:
            return list(computed)
        return cut(torch.from_numpy(computed), dim, normalize_embeddings).numpy()

    def quantize(matrix: np.ndarray, _: np.ndarray) -> np.ndarray:
        bound = calibration.bound(("encode", *kind), calibrate)
        return quantize_symmetric(matrix, precision, bound)

    return quantize


def encode_output(
    embeddings: list | torch.Tensor,
    precision: str,
    quantize: Quantize,
    convert_to_numpy: bool,
    convert_to_tensor: bool,
) -> Any:
    """The end of ``SentenceTransformer.encode``, step for step: quantize (``quantize``), then
    the requested container (an empty call stays ``[0, dim]``, of the precision's dtype)."""
    if not len(embeddings):
        if isinstance(embeddings, list):
            return []
        width = embeddings.shape[1]
        if precision.endswith("binary"):
            width = (width + 7) // 8
        dtype = {"float32": np.float32, "uint8": np.uint8, "ubinary": np.uint8}.get(precision)
        empty = np.zeros((0, width), dtype or np.int8)
        if convert_to_tensor:
            return torch.from_numpy(empty)
        return empty if convert_to_numpy else []
    if precision != "float32":
        if isinstance(embeddings, list):  # token matrices: the "call" rule spans all of them
            matrices = [e.numpy() for e in embeddings]
            whole = np.concatenate(matrices)
            embeddings = [quantize(m, whole) for m in matrices]
        else:
            vectors = embeddings.numpy()
            quantized = quantize(vectors, vectors)
            if convert_to_tensor:
                return torch.from_numpy(quantized)
            return quantized if convert_to_numpy else [torch.from_numpy(q) for q in quantized]
    if convert_to_tensor:
        return embeddings if isinstance(embeddings, torch.Tensor) else torch.stack(embeddings)
    if convert_to_numpy:
        assert isinstance(embeddings, torch.Tensor), "token outputs never convert to numpy"
        return embeddings.numpy()
    return list(embeddings)
