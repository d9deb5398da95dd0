"""Sums of contiguous row ranges of a step's hidden states, in fp32, as one Triton kernel.

Why: MEAN pooling sums each request's rows. ``index_add_`` over a per-row slot array does it with an
fp32 copy of the whole step and atomic adds: 0.13 ms of a 3 ms MiniLM step on an H200
(docs/benchmarks/gpu-short-inputs.md), and a 256 KiB slot array to upload. A request's rows are
contiguous in the packed batch, so one program per (range, block of columns) reads its rows once,
adds them in fp32 registers and writes the sum.
"""

from __future__ import annotations

import torch

from .triton_support import INTERPRETING, tl, triton

if triton is not None:

    @triton.jit
    def _segment_sum_kernel(
        x_ptr, out_ptr, bounds_ptr, num_segments, width, stride_x, stride_out,
        BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, LOOP_AS_WHILE: tl.constexpr,
    ):  # fmt: skip
        segment, column_block = tl.program_id(0), tl.program_id(1)
        start = tl.load(bounds_ptr + segment)
        length = tl.load(bounds_ptr + num_segments + segment)
        cols = column_block * BLOCK_H + tl.arange(0, BLOCK_H)
        in_width = cols < width
        acc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
        if LOOP_AS_WHILE:  # Triton's interpreter cannot range() over loaded bounds
            t = 0
            while t < length:
                rows = t + tl.arange(0, BLOCK_T)
                mask = (rows < length)[:, None] & in_width[None, :]
                ptrs = x_ptr + (start + rows)[:, None] * stride_x + cols[None, :]
                acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
                t += BLOCK_T
        else:
            for t in range(0, length, BLOCK_T):
                rows = t + tl.arange(0, BLOCK_T)
                mask = (rows < length)[:, None] & in_width[None, :]
                ptrs = x_ptr + (start + rows)[:, None] * stride_x + cols[None, :]
                acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + segment * stride_out + cols, tl.sum(acc, 0), mask=in_width)


def supported(device: torch.device) -> bool:
    """Where the engine sums with the kernel (tests also run it in Triton's interpreter)."""
    return triton is not None and device.type == "cuda"


def segment_sums(x: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """x: [T, H]; bounds: int64 ``[2S]`` on x's device, the S first rows then the S lengths
    -> [S, H] float32, row j the sum of ``x[start_j : start_j + length_j]``."""
    num_segments = bounds.shape[0] // 2
    width = x.shape[1]
    out = torch.empty((num_segments, width), dtype=torch.float32, device=x.device)
    if num_segments == 0:
        return out
    assert x.stride(1) == 1, "segment sums need contiguous rows"
    block_h = min(128, triton.next_power_of_2(width))
    grid = (num_segments, triton.cdiv(width, block_h))
    _segment_sum_kernel[grid](
        x, out, bounds, num_segments, width, x.stride(0), out.stride(0),
        BLOCK_T=16, BLOCK_H=block_h, LOOP_AS_WHILE=INTERPRETING, num_warps=4,
    )  # fmt: skip
    return out
