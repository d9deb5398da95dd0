"""Heads on the last stage, over a whole step's pooled outputs at once, on the device:
sentence-transformers ``Dense`` modules, then Matryoshka truncation, then L2 normalisation,
so a ``dimensions`` vector is a unit vector (as in vLLM and the OpenAI API). A classifier's
rows go through its score head and activation instead (``ScoreHead``).

sentence-transformers 6 orders it the other way for a folder with a Normalize module: it
runs every module (Normalize included), then cuts to ``truncate_dim``, so its truncated
vectors are shorter than 1; ours equal its ``encode(..., truncate_dim=d,
normalize_embeddings=True)`` and differ from plain ``truncate_dim=d`` only in length (cosine
1). tests/test_sentence_transformers.py pins both facts down.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..layers.activation import get_activation
from ..loading.st_dense import DenseModule
from ..loading.weights import load_linear


class DenseHead(nn.Module):
    """A chain of sentence-transformers Dense modules: activation(linear(x)), in order."""

    def __init__(self, modules: tuple[DenseModule, ...]) -> None:
        super().__init__()
        self.linears = nn.ModuleList()
        self.activations = []
        for m in modules:
            linear = nn.Linear(m.in_features, m.out_features, bias=m.bias)
            tensors = load_linear(m.path)
            with torch.no_grad():
                linear.weight.copy_(tensors["linear.weight"])
                if m.bias:
                    linear.bias.copy_(tensors["linear.bias"])
            self.linears.append(linear)
            self.activations.append(get_activation(m.activation))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for linear, act in zip(self.linears, self.activations, strict=True):
            x = act(linear(x))
        return x


@dataclass(frozen=True)
class HeadParams:
    """Per-row Matryoshka width (0 = all) and normalisation, for the rows of one output.

    ``normalize`` is the model's own finishing step, on unless a request asks for raw values:
    L2 normalisation of an embedding, the activation of a classifier's logits (as vLLM's
    ``use_activation`` covers both).

    Built on the host before the forward. When every row asks the same (the usual case: a
    step's requests come from a few batches) the values are plain scalars; otherwise the
    per-row arrays ride in the step's single upload (``dims_t`` / ``norm_t``).
    """

    dims: np.ndarray  # [n] int64
    normalize: np.ndarray  # [n] bool

    @property
    def uniform(self) -> bool:
        return len(self.dims) == 0 or (
            bool((self.dims == self.dims[0]).all())
            and bool((self.normalize == self.normalize[0]).all())
        )

    def upload_arrays(self) -> list[np.ndarray | None]:
        if self.uniform:
            return [None, None]
        return [self.dims, self.normalize.astype(np.int64)]


def apply_heads(
    x: torch.Tensor,
    params: HeadParams,
    dims_t: torch.Tensor | None,
    norm_t: torch.Tensor | None,
) -> torch.Tensor:
    """x: [n, D] float32 -> [n, D'] float32. With uniform parameters D' is the common width;
    otherwise D' = D and components past a row's width are zero (the driver cuts each
    request to its own width)."""
    if not len(x):
        return x
    if params.uniform:
        width = int(params.dims[0])
        if width:
            x = x[:, :width]
        return l2_normalize(x) if bool(params.normalize[0]) else x
    # Rows that ask different things carry their per-row arrays (HeadParams.upload_arrays).
    assert dims_t is not None and norm_t is not None, "non-uniform rows come with their arrays"
    cols = torch.arange(x.shape[1], device=x.device)
    keep = (dims_t == 0).unsqueeze(1) | (cols.unsqueeze(0) < dims_t.unsqueeze(1))  # [n, D]
    x = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))
    normed = l2_normalize(x)
    return torch.where(norm_t.bool().unsqueeze(1), normed, x)


def l2_normalize(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """``F.normalize(x, dim=-1)``, the same arithmetic (norm, clamp, divide) without its
    Python layers (``Tensor.norm`` goes through ``torch.functional.norm``): this runs once per
    step on the host's critical path."""
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(eps)


# A classifier's activation over its labels (classifier.SCORE_ACTIVATIONS).
_SCORE_ACTIVATIONS = {
    "identity": lambda x: x,
    "sigmoid": torch.sigmoid,
    "softmax": lambda x: torch.softmax(x, dim=-1),
    "tanh": torch.tanh,
    "relu": F.relu,
}


class ScoreHead:
    """A classifier's head over a step's pooled rows: logits from the model's head module
    (``models/score_heads.py``), then its activation on the rows whose request wants it (all
    but those asking for raw logits)."""

    def __init__(self, module: nn.Module, activation: str) -> None:
        self.module = module
        self.activation = _SCORE_ACTIVATIONS[activation]

    def __call__(
        self, x: torch.Tensor, params: HeadParams, use_t: torch.Tensor | None
    ) -> torch.Tensor:
        """x: [n, hidden] pooled rows -> [n, num_labels] float32."""
        logits = self.module(x.float())
        if not len(logits):
            return logits
        if params.uniform:
            return self.activation(logits) if bool(params.normalize[0]) else logits
        assert use_t is not None, "non-uniform rows come with their array"
        return torch.where(use_t.bool().unsqueeze(1), self.activation(logits), logits)
