"""Batch-invariant CUDA kernels: a GEMM and row sums whose per-row arithmetic is fixed.

cuBLAS chooses a kernel per problem shape, and for few rows it may split K across thread
blocks and add the partial products in another order; torch's CUDA reductions spread a row
over more threads when there are few rows. Both make a row's bits depend on M, the step's
row count. Here every launch uses one tile configuration per dtype, whatever M:

- :func:`matmul`: each program owns one ``BLOCK_M x BLOCK_N`` output tile and walks K in
  ``BLOCK_K`` steps from 0, accumulating in fp32 (no split-K, no stream-K); a row's outputs
  are the same dot products in the same order wherever the row sits and however many rows
  there are. fp32 inputs multiply in IEEE fp32 (no TF32).
- :func:`row_sums`: one program per row, ``BLOCK`` lanes that stride along the row, then one
  fixed tree across the lanes.
- :func:`rms_norm`: ``layers.norm.rms_norm`` as one program per row holding the whole row
  (one fixed tree over a block sized by the row's width), one kernel where the eager form
  launches nine.
- :func:`add_layer_norm`: a post-norm encoder's ``layer_norm(residual + (y + bias))`` the same
  way, one pass where the eager form reads and writes the rows three times.

The ideas are those of Thinking Machines' "Defeating Nondeterminism in LLM Inference" (fixed
reduction strategies per kernel, independent of the batch); the kernels are this module's.
"""

from __future__ import annotations

import torch

from .triton_support import INTERPRETING, tl, triton

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) per input dtype: one configuration per dtype,
# never chosen by M. bf16/fp16: the usual Hopper/Ampere tile; fp32 (IEEE, heads on pooled
# vectors) a smaller one that fits shared memory.
TILES = {
    torch.bfloat16: (128, 128, 64, 8, 3),
    torch.float16: (128, 128, 64, 8, 3),
    torch.float32: (64, 64, 32, 4, 2),
}
GROUP_M = 8  # programs of one column band run together (L2 reuse of B; no effect on results)
ROW_BLOCK = 1024
NORM_MAX_WIDTH = 16384  # widest row :func:`rms_norm` holds in one program

if triton is not None:

    @triton.jit
    def _k_step(
        a_ptrs, b_ptrs, acc, rm, rn, rk, M, N, left, IEEE: tl.constexpr, EVEN_K: tl.constexpr
    ):
        """One BLOCK_K slice of K added to the tile's fp32 accumulator."""
        if EVEN_K:  # K is a whole number of slices: no mask along K
            a = tl.load(a_ptrs, mask=rm[:, None] < M, other=0.0)
            b = tl.load(b_ptrs, mask=rn[None, :] < N, other=0.0)
        else:
            a = tl.load(a_ptrs, mask=(rm[:, None] < M) & (rk[None, :] < left), other=0.0)
            b = tl.load(b_ptrs, mask=(rk[:, None] < left) & (rn[None, :] < N), other=0.0)
        if IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _matmul_kernel(
        a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K,
        stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
        HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP: tl.constexpr, LOOP_AS_WHILE: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        bands_m = tl.cdiv(M, BLOCK_M)
        bands_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP * bands_n
        first_m = (pid // per_group) * GROUP
        group_size = tl.minimum(bands_m - first_m, GROUP)
        pid_m = first_m + (pid % per_group) % group_size
        pid_n = (pid % per_group) // group_size
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
        b_ptrs = b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if LOOP_AS_WHILE:  # Triton's interpreter cannot range() over a runtime bound
            k = 0
            while k < K:
                acc = _k_step(a_ptrs, b_ptrs, acc, rm, rn, rk, M, N, K - k, IEEE, EVEN_K)
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
                k += BLOCK_K
        else:
            for k in range(0, K, BLOCK_K):
                acc = _k_step(a_ptrs, b_ptrs, acc, rm, rn, rk, M, N, K - k, IEEE, EVEN_K)
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _row_sum_kernel(
        x_ptr, out_ptr, N, stride_x,
        SQUARE: tl.constexpr, BLOCK: tl.constexpr, LOOP_AS_WHILE: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        if LOOP_AS_WHILE:  # Triton's interpreter cannot range() over a runtime bound
            start = 0
            while start < N:
                acc += _lanes(x_ptr + row * stride_x, start, N, SQUARE, BLOCK)
                start += BLOCK
        else:
            for start in range(0, N, BLOCK):
                acc += _lanes(x_ptr + row * stride_x, start, N, SQUARE, BLOCK)
        tl.store(out_ptr + row, tl.sum(acc, 0))

    @triton.jit
    def _lanes(row_ptr, start, N, SQUARE: tl.constexpr, BLOCK: tl.constexpr):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        if SQUARE:
            x = x * x
        return x

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, w_ptr, out_ptr, N, stride_x, stride_out, eps, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        x32 = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / N + eps)
        # Rounded to the input's dtype, then scaled as a product of that and the weight.
        y = (x32 * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_layer_norm_kernel(
        y_ptr, bias_ptr, res_ptr, w_ptr, b_ptr, out_ptr, N, stride_y, stride_res, stride_out,
        eps, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        dtype = y_ptr.dtype.element_ty
        y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
        bias = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        # Each addition rounded to the rows' dtype, as the eager additions round it.
        s = (y + bias).to(dtype).to(tl.float32)
        s = (s + res).to(dtype).to(tl.float32)
        mean = tl.sum(s, 0) / N
        centred = tl.where(mask, s - mean, 0.0)
        inv = 1.0 / tl.sqrt(tl.sum(centred * centred, 0) / N + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        out = centred * inv * w + b
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def add_layer_norm(
    y: torch.Tensor,
    bias: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    norm_bias: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """``layer_norm(residual + (y + bias), weight, norm_bias, eps)`` over the last dimension
    of ``y`` [M, N] (a product without its bias) and ``residual`` [M, N]: each addition rounded
    to ``y``'s dtype, the norm in fp32, each row by one program whatever M. Rows wider than
    :data:`NORM_MAX_WIDTH` are refused (the caller keeps the eager form)."""
    if triton is None:
        raise RuntimeError("batch-invariant LayerNorm on CUDA needs Triton")
    m, width = y.shape
    if width > NORM_MAX_WIDTH:
        raise ValueError(
            f"rows of {width} values: the fused LayerNorm holds at most {NORM_MAX_WIDTH}"
        )
    if residual.shape != y.shape:
        raise ValueError(f"residual {tuple(residual.shape)} for rows {tuple(y.shape)}")
    y = y if y.stride(-1) == 1 else y.contiguous()
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    out = torch.empty_like(y, memory_format=torch.contiguous_format)
    if m:
        block = triton.next_power_of_2(width)
        _add_layer_norm_kernel[(m,)](
            y, bias.contiguous(), residual, weight.contiguous(), norm_bias.contiguous(), out,
            width, y.stride(0), residual.stride(0), out.stride(0), eps, BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),
        )  # fmt: skip
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``layers.norm.rms_norm`` (normalise in fp32, round to ``x``'s dtype, scale by
    ``weight``) over the last dimension, each row by one program whatever the row count; rows
    wider than :data:`NORM_MAX_WIDTH` are refused (the caller keeps the eager form)."""
    if triton is None:
        raise RuntimeError("batch-invariant RMSNorm on CUDA needs Triton")
    width = x.shape[-1]
    if width > NORM_MAX_WIDTH:
        raise ValueError(
            f"rows of {width} values: the fused RMSNorm holds at most {NORM_MAX_WIDTH}"
        )
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype),
                      device=x.device)  # fmt: skip
    if len(rows):
        block = triton.next_power_of_2(width)
        _rms_norm_kernel[(len(rows),)](
            rows, weight, out, width, rows.stride(0), out.stride(0), eps, BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),
        )  # fmt: skip
    return out.view(*x.shape[:-1], width)


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b + bias`` for ``a`` [M, K], ``b`` [K, N] (any strides: a weight's ``.t()``
    view included) -> [M, N] in ``a``'s dtype, each row computed the same whatever M."""
    if triton is None:
        raise RuntimeError("batch-invariant matmul on CUDA needs Triton")
    if b.dtype != a.dtype:
        raise TypeError(f"matmul of {a.dtype} by {b.dtype}: the dtypes must agree")
    m, k = a.shape
    n = b.shape[1]
    out = a.new_empty((m, n))
    if m == 0:
        return out
    block_m, block_n, block_k, warps, stages = TILES[a.dtype]
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _matmul_kernel[grid](
        a, b, bias if bias is not None else a, out, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, IEEE=a.dtype == torch.float32, EVEN_K=k % block_k == 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP=GROUP_M,
        LOOP_AS_WHILE=INTERPRETING, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def row_sums(x: torch.Tensor, *, square: bool = False) -> torch.Tensor:
    """[M, N] -> [M] float32: each row's sum (of squares with ``square``), one program per
    row with a fixed lane count, whatever M."""
    if triton is None:
        raise RuntimeError("batch-invariant row sums on CUDA need Triton")
    m, n = x.shape
    out = torch.empty(m, dtype=torch.float32, device=x.device)
    if m == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    block = min(ROW_BLOCK, triton.next_power_of_2(n))
    _row_sum_kernel[(m,)](
        x, out, n, x.stride(0), SQUARE=square, BLOCK=block, LOOP_AS_WHILE=INTERPRETING,
        num_warps=4,
    )  # fmt: skip
    return out
