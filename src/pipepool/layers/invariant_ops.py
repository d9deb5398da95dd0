"""Batch-invariant math: a row's result depends on that row alone, never on how many rows
share the step or where the row sits among them (``EngineConfig.batch_invariant``).

Why it is not so by default: a GEMM library picks its kernel, blocking and thread split from
the problem's shape. MKL's sgemm gives different bits for the same row at M = 1..11 than at
larger M (measured on 2 AMD EPYC cores, torch 2.13), cuBLAS splits K when M is small, and a
CUDA reduction spreads one row over more threads when there are few rows. Each is a correct
float result; together they make a text's vector move with its batch-mates in the last bits.

How: while :class:`BatchInvariantMode` is active (the stage runner enters it around each
forward and the pooling when the option is on), the matrix products of the layers and heads
go through :func:`invariant_linear`, which computes every row with one fixed-shape problem:

- CPU: rows cut into tiles of ``CPU_TILE_ROWS`` and multiplied as a batch of
  ``[CPU_TILE_ROWS, K] x [K, N]`` products (``invariant_tiles.tiled_matmul``: ``torch.bmm``
  over an expanded weight): each tile is the same GEMM whatever the step, so the same kernel
  and the same K-order for every row. (One plain ``F.linear`` over the padded rows gave the
  same bits here, but only because MKL happens to pick one path for M >= 12 on this CPU; the
  tiles do not depend on that.)
- CUDA, bf16/fp16: the same with cuBLAS at 256-row tiles, for each (K, N) whose tiles pass
  ``invariant_tiles.cuda_tiles_agree`` (checked once per shape); other shapes and fp32 take a
  Triton GEMM with one tile configuration and no split-K (``invariant_triton``). Row sums
  (``mean`` / ``sum`` / ``vector_norm`` over the last dimension, as RMSNorm and the L2 head use
  them) as one program per row.

On CUDA a product's bias (and the GELU of ``torch._addmm_activation``) is added in one
elementwise Triton pass over it in place (``gated_activation.add_bias_`` /
``bias_gelu_tanh_``), where cuBLASLt's epilogues would have done it in the default path.

Attention keeps its own invariant kernel (``attention.attend`` asks :func:`active`). Norms
that torch computes one row per thread block (``layer_norm``) or one row per loop iteration
(every CPU reduction over the last dimension of fewer than 32,768 elements) are row-local
already and pass through. Products the mode cannot make invariant (batched 3-D ones on CUDA,
``einsum``) raise :class:`BatchInvarianceError` rather than silently varying.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import gated_activation, invariant_tiles

# Rows per CPU GEMM tile: small enough that short steps waste little on padding, large enough
# that each tile runs MKL's blocked kernel at full speed (measured: bmm over 16-row tiles ran
# at F.linear's speed for MiniLM's shapes at 2048 rows).
CPU_TILE_ROWS = 16

_state = threading.local()


class BatchInvarianceError(RuntimeError):
    """An operation inside a batch-invariant forward that has no invariant form here."""


def active() -> bool:
    """Whether this thread is inside :func:`batch_invariant` (the layers ask, to pick their
    invariant kernels)."""
    return getattr(_state, "depth", 0) > 0


@contextmanager
def batch_invariant(on: bool = True) -> Iterator[None]:
    """Run the enclosed torch code with batch-invariant products (a no-op when ``on`` is
    false, so callers need no branch)."""
    if not on:
        yield
        return
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        with BatchInvariantMode():
            yield
    finally:
        _state.depth -= 1


@contextmanager
def fixed_shapes() -> Iterator[None]:
    """Inside an invariant kernel whose products are fixed-shape by construction
    (invariant_attention): torch ops run as they are, not through the mode."""
    with torch._C.DisableTorchFunction():
        yield


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` [..., K], ``weight`` [N, K], each output row
    computed the same way whatever the other rows."""
    return invariant_matmul(x, weight.t(), bias)


def invariant_matmul(
    x: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ b + bias`` for ``x`` [..., K] and a 2-D ``b`` [K, N], invariant per row."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    n = b.shape[1]
    if not x.is_cuda:
        out = invariant_tiles.tiled_matmul(rows, b, CPU_TILE_ROWS)
    elif x.dtype in invariant_tiles.TILED_DTYPES and invariant_tiles.cuda_tiles_agree(
        k, n, x.dtype, x.device
    ):
        out = invariant_tiles.tiled_matmul(
            rows, b, invariant_tiles.CUDA_TILE_ROWS, invariant_tiles.MAX_LAUNCH_TILES
        )
    else:
        from . import invariant_triton

        return invariant_triton.matmul(rows, b, bias).view(*lead, n)
    if bias is not None:
        if gated_activation.available(out.device, out.dtype) and bias.dim() == 1:
            out = gated_activation.add_bias_(out, bias)  # vectorised, the same bits
        else:
            out = out + bias
    return out.view(*lead, n)


def _row_reduce(x: torch.Tensor, kind: str, dim, keepdim: bool, dtype=None) -> torch.Tensor:
    """sum / mean / L2 norm over the last dimension, one program per row (CUDA)."""
    from . import invariant_triton

    width = x.shape[-1]
    rows = x.reshape(-1, width)
    if dtype is not None:
        rows = rows.to(dtype)
    sums = invariant_triton.row_sums(rows, square=kind == "norm")  # fp32 [M]
    if kind == "mean":
        sums = sums / width
    elif kind == "norm":
        sums = sums.sqrt()
    out = sums.to(rows.dtype).view(x.shape[:-1])
    return out.unsqueeze(-1) if keepdim else out


def _is_last_dim(x: torch.Tensor, dim) -> bool:
    if isinstance(dim, (tuple, list)):
        if len(dim) != 1:
            return False
        dim = dim[0]
    return isinstance(dim, int) and dim in (-1, x.dim() - 1)


_LINEARS = {F.linear, torch._C._nn.linear}
_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm}
_ADDMMS = {torch.addmm, torch.Tensor.addmm}
_UNSUPPORTED = {
    torch.bmm, torch.Tensor.bmm, torch.baddbmm, torch.Tensor.baddbmm, torch.einsum,
    F.scaled_dot_product_attention,
}  # fmt: skip
_SUMS = {torch.sum: "sum", torch.Tensor.sum: "sum", torch.mean: "mean", torch.Tensor.mean: "mean"}
_NORMS = {torch.linalg.vector_norm, torch.norm, torch.Tensor.norm}


class BatchInvariantMode(TorchFunctionMode):
    """Routes a forward's matrix products (and, on CUDA, its row reductions) to their
    batch-invariant forms; everything else runs as it is. Enter it with
    :func:`batch_invariant`, which also makes :func:`active` true."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LINEARS:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return invariant_linear(x, weight, bias)
        if func in _MATMULS and args[1].dim() == 2 and args[0].dim() >= 2:
            return invariant_matmul(args[0], args[1])
        plain_scales = kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1
        if func in _ADDMMS and len(args) == 3 and set(kwargs) <= {"beta", "alpha"} and plain_scales:
            bias, x, b = args
            return invariant_matmul(x, b, bias)
        if func is torch._addmm_activation:
            bias, x, b = args[:3]
            gelu = kwargs.get("use_gelu", args[5] if len(args) > 5 else False)
            if gelu and gated_activation.available(x.device, x.dtype) and bias.dim() == 1:
                # The bias and the GELU in one pass over the product (elementwise: invariant).
                return gated_activation.bias_gelu_tanh_(invariant_matmul(x, b), bias)
            out = invariant_matmul(x, b, bias)
            return F.gelu(out, approximate="tanh") if gelu else F.relu(out)
        if func in _MATMULS or func in _ADDMMS or func in _UNSUPPORTED:
            raise BatchInvarianceError(
                f"{getattr(func, '__name__', func)} has no batch-invariant form; this model "
                "cannot run with batch_invariant"
            )
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.is_cuda and x.dim() >= 1:
            reduced = self._cuda_reduction(func, x, args, kwargs)
            if reduced is not None:
                return reduced
        return func(*args, **kwargs)

    @staticmethod
    def _cuda_reduction(func, x: torch.Tensor, args, kwargs) -> torch.Tensor | None:
        """A row reduction over the last dimension, as one program per row; None: not one."""
        if func in _SUMS:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
            if dim is not None and _is_last_dim(x, dim):
                return _row_reduce(x, _SUMS[func], dim, keepdim, kwargs.get("dtype"))
            return None
        if func in _NORMS:
            order = args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("p", 2))
            dim = args[2] if len(args) > 2 else kwargs.get("dim")
            keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
            if order in (2, 2.0, "fro") and dim is not None and _is_last_dim(x, dim):
                return _row_reduce(x, "norm", dim, keepdim)
            return None
        if func is F.normalize:
            p = args[1] if len(args) > 1 else kwargs.get("p", 2.0)
            dim = args[2] if len(args) > 2 else kwargs.get("dim", 1)
            eps = args[3] if len(args) > 3 else kwargs.get("eps", 1e-12)
            if p == 2 and _is_last_dim(x, dim):
                return x / _row_reduce(x, "norm", dim, True).clamp_min(eps)
        return None
