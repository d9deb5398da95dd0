"""Per-request heads applied on the driver to what the last stage pooled: Matryoshka
truncation, then L2 normalisation (the order sentence-transformers uses for
``truncate_dim`` with a Normalize module)."""

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
