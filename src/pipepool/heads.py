"""Per-request heads applied on the driver to what the last stage pooled: Matryoshka
truncation, then L2 normalisation, so a ``dimensions`` vector is a unit vector (as in vLLM and
the OpenAI API).

sentence-transformers 6 orders it the other way for a folder with a Normalize module: it
runs every module (Normalize included), then cuts to ``truncate_dim``, so its truncated
vectors are shorter than 1; ours equal its ``encode(..., truncate_dim=d,
normalize_embeddings=True)`` and differ from plain ``truncate_dim=d`` only in length (cosine
1). tests/test_sentence_transformers.py pins both facts down."""

from __future__ import annotations

import numpy as np

from .request import PoolingParams


def apply_heads(output: np.ndarray, params: PoolingParams) -> np.ndarray:
    """``output``: a pooled vector [D] or token embeddings [len, H] (float32)."""
    if params.dimensions is not None:
        output = output[..., : params.dimensions]
    if params.normalize:
        norm = np.linalg.norm(output, axis=-1, keepdims=True)
        output = output / np.maximum(norm, 1e-12)  # F.normalize's epsilon
    return np.ascontiguousarray(output, dtype=np.float32)
