"""Normalisation layers, computed in fp32 like the reference implementations."""

from __future__ import annotations

import torch
from torch import nn

from . import invariant_ops, invariant_triton


class RMSNorm(nn.Module):
    """LLaMA-style RMSNorm: normalise in fp32, cast back, then scale (the order HF uses, which
    matters for bf16 parity)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def invariant_row_kernels(x: torch.Tensor) -> bool:
    """Whether norms over ``x``'s rows run as ``invariant_triton``'s one-program-per-row
    kernels: a batch-invariant forward on CUDA (never compiled), rows no wider than they hold."""
    return (
        not torch.compiler.is_compiling()
        and x.is_cuda
        and invariant_ops.active()
        and x.shape[-1] <= invariant_triton.NORM_MAX_WIDTH
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if invariant_row_kernels(x):  # one kernel, each row its own bits
        return invariant_triton.rms_norm(x, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)
