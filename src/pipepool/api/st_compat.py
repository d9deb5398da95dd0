"""``Engine.encode`` / ``similarity`` with sentence-transformers' signatures and results, so
code written for ``SentenceTransformer`` runs on the engine unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InvalidInputError
from .progress import follow

if TYPE_CHECKING:
    from .engine import Engine

PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")
OUTPUT_VALUES = ("sentence_embedding", "token_embeddings")
SIMILARITIES = ("cosine", "dot", "euclidean", "manhattan")


def encode(
    engine: Engine,
    sentences: str | Sequence[str],
    *,
    show_progress_bar: bool | None,
    output_value: str,
    precision: str,
    convert_to_numpy: bool,
    convert_to_tensor: bool,
    normalize_embeddings: bool,
    prompt_name: str | None,
    truncate_dim: int | None,
):
    if output_value not in OUTPUT_VALUES:
        raise InvalidInputError(
            f"output_value must be one of {', '.join(OUTPUT_VALUES)}; got {output_value!r}",
            param="output_value",
        )
    if precision not in PRECISIONS:
        raise InvalidInputError(
            f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}",
            param="precision",
        )
    single = isinstance(sentences, str)
    tokens = output_value == "token_embeddings"
    # The model's own heads (Normalize included) run in the engine; then, as in
    # sentence-transformers, truncate_dim cuts the final vectors (no renormalising, unlike the
    # engine's `dimensions`) and normalize_embeddings normalises what is left.
    submission = engine.submit(
        [sentences] if single else sentences,
        pooling="all" if tokens else None,
        prompt_name=prompt_name,
    )
    follow(submission, disable=not show_progress_bar, desc="Batches")
    result = submission.result()
    if tokens:
        out = list(result)
        return out[0] if single else out
    vectors = result[:, :truncate_dim] if truncate_dim else result
    if normalize_embeddings:
        vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    vectors = quantize(vectors.astype(np.float32, copy=False), precision)
    if convert_to_tensor:
        import torch

        vectors = torch.from_numpy(vectors)
    elif not convert_to_numpy:
        vectors = list(vectors)  # sentence-transformers: a list of 1-D vectors
    return vectors[0] if single else vectors


def quantize(vectors: np.ndarray, precision: str) -> np.ndarray:
    """sentence-transformers' ``quantize_embeddings`` with buckets from the vectors themselves
    (what ``encode(precision=...)`` does)."""
    if precision == "float32":
        return vectors
    if precision.endswith("int8"):
        if len(vectors) == 0:
            return np.zeros(vectors.shape, np.int8 if precision == "int8" else np.uint8)
        starts = vectors.min(axis=0)
        steps = (vectors.max(axis=0) - starts) / 255
        steps = np.where(steps == 0, 1, steps)
        buckets = np.clip(np.floor((vectors - starts) / steps), 0, 255)
        return buckets.astype(np.uint8) if precision == "uint8" else (buckets - 128).astype(np.int8)
    packed = np.packbits(vectors > 0, axis=-1).reshape(len(vectors), -1)
    return packed if precision == "ubinary" else (packed - 128).astype(np.int8)


def similarity(a, b, fn_name: str | None) -> np.ndarray:
    """``[len(a), len(b)]`` float32 scores, as sentence-transformers' ``similarity`` (negated
    distances for euclidean and manhattan, so that larger is always more similar)."""
    fn_name = fn_name or "cosine"
    if fn_name not in SIMILARITIES:
        raise InvalidInputError(f"unknown similarity function {fn_name!r}")
    x = np.atleast_2d(np.asarray(a, dtype=np.float64))
    y = np.atleast_2d(np.asarray(b, dtype=np.float64))
    if fn_name in ("cosine", "dot"):
        if fn_name == "cosine":
            x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
            y = y / np.maximum(np.linalg.norm(y, axis=1, keepdims=True), 1e-12)
        return (x @ y.T).astype(np.float32)
    order = 2 if fn_name == "euclidean" else 1
    distance = np.linalg.norm(x[:, None, :] - y[None, :, :], ord=order, axis=-1)
    return (-distance).astype(np.float32)
