"""Variable-length attention forward as one Triton kernel (CUDA, bf16/fp16).

Why: aten's flash kernel (FlashAttention-2, built for sm80) runs the packed steps of a pooling
engine at about 90 TFLOP/s on an H200 — short sequences, 32-dim heads for the small encoders —
while the matmuls around it run at 500-700. This kernel tiles the same way (a block of
queries of one request and one query head at a time, online softmax over blocks of keys) with
tile sizes chosen per head size for such steps. Its grid is derived from the step, or (encoders)
its programs take items of a work list (request, query block) that the host builds with the
step's inputs, so that one launch with a fixed grid serves any step and can live inside a CUDA
graph (stage/cuda_graphs.py captures an encoder's whole forward that way).

Layout and masks are those of :func:`.attention.attend`: packed q ``[T, Hq, D]``, packed k/v
``[Tk, Hkv, D]`` (GQA: query head h reads KV head h // (Hq / Hkv)), per-request offsets
``cu_seqlens_q`` / ``cu_seqlens_k``; causal masks aligned bottom-right (a chunk is the last
queries of its keys), an optional sliding window of ``window`` keys, itself included, or
(bidirectional) ``window`` keys on either side; scores optionally soft-capped (Gemma2's
``cap * tanh(s / cap)``, in float32 before the softmax) and optionally biased by the distance
between key and query (T5's and MPNet's relative position bias, from a table by distance).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .triton_support import INTERPRETING, tl, triton

if triton is not None:

    @triton.jit
    def _capped(s, cap_log2, SOFTCAP: tl.constexpr):
        """Gemma2's soft-capping ``cap * tanh(score / cap)``, on base-2 scores (both sides
        times log2(e)); tanh(x) as 2 * sigmoid(2x) - 1."""
        if SOFTCAP:
            s = cap_log2 * (2.0 * tl.sigmoid(2.0 * s / cap_log2) - 1.0)
        return s

    @triton.jit
    def _biased(s, cols, positions, bias_row, max_distance, BIASED: tl.constexpr):
        """The relative position bias (T5, MPNet) added to base-2 scores: ``bias_row`` points
        at distance 0 of this head's table, which holds every ``key - query`` distance from
        ``-max_distance`` to ``max_distance`` (longer ones share the end entries)."""
        if BIASED:
            rel = cols[None, :] - positions[:, None]
            rel = tl.minimum(tl.maximum(rel, -max_distance), max_distance)
            s = s + tl.load(bias_row + rel) * 1.4426950408889634  # log2(e)
        return s

    @triton.jit
    def _attend_block(
        q, k_base, v_base, start, len_k, positions, window, scale_log2, cap_log2, bias_row,
        max_distance, m_i, l_i, acc, stride_kt, stride_vt, dims,
        MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
        SOFTCAP: tl.constexpr, BIASED: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """One block of keys: scores, online-softmax update, the weighted values added.
        Unmasked (``MASKED`` false) where every row sees every key of the block: no bounds
        on the loads, no select on the scores."""
        cols = start + tl.arange(0, BLOCK_N)
        if MASKED:
            inside = cols < len_k
            k = tl.load(
                k_base + cols[None, :] * stride_kt + dims[:, None],
                mask=inside[None, :], other=0.0,
            )  # fmt: skip
            s = _capped(tl.dot(q, k) * scale_log2, cap_log2, SOFTCAP)
            s = _biased(s, cols, positions, bias_row, max_distance, BIASED)
            visible = inside[None, :]
            if CAUSAL:
                visible = visible & (cols[None, :] <= positions[:, None])
                if WINDOWED:
                    visible = visible & (cols[None, :] > positions[:, None] - window)
            elif WINDOWED:  # bidirectional: ``window`` keys on either side, as well as itself
                near = (cols[None, :] >= positions[:, None] - window) & (
                    cols[None, :] <= positions[:, None] + window
                )
                visible = visible & near
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row may see no key of this block (a window), or none at all (a chunk longer
            # than its keys: flash returns zeros there): keep exp2's argument finite.
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
            v = tl.load(
                v_base + cols[:, None] * stride_vt + dims[None, :],
                mask=inside[:, None], other=0.0,
            )  # fmt: skip
        else:
            k = tl.load(k_base + cols[None, :] * stride_kt + dims[:, None])
            s = _capped(tl.dot(q, k) * scale_log2, cap_log2, SOFTCAP)
            s = _biased(s, cols, positions, bias_row, max_distance, BIASED)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            v = tl.load(v_base + cols[:, None] * stride_vt + dims[None, :])
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _attend_span(
        q, k_base, v_base, lo, hi, len_k, positions, window, scale_log2, cap_log2, bias_row,
        max_distance, m_i, l_i, acc, stride_kt, stride_vt, dims,
        MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
        SOFTCAP: tl.constexpr, BIASED: tl.constexpr, BLOCK_N: tl.constexpr,
        LOOP_AS_WHILE: tl.constexpr,
    ):  # fmt: skip
        """The blocks of keys from ``lo`` to ``hi`` (a multiple of BLOCK_N apart, or the end
        of the keys), all masked or all unmasked."""
        if LOOP_AS_WHILE:  # Triton's interpreter cannot range() over loaded bounds
            start = lo
            while start < hi:
                m_i, l_i, acc = _attend_block(
                    q, k_base, v_base, start, len_k, positions, window, scale_log2, cap_log2,
                    bias_row, max_distance, m_i, l_i, acc, stride_kt, stride_vt, dims, MASKED,
                    CAUSAL, WINDOWED, SOFTCAP, BIASED, BLOCK_N,
                )  # fmt: skip
                start += BLOCK_N
        else:
            for start in range(lo, hi, BLOCK_N):
                m_i, l_i, acc = _attend_block(
                    q, k_base, v_base, start, len_k, positions, window, scale_log2, cap_log2,
                    bias_row, max_distance, m_i, l_i, acc, stride_kt, stride_vt, dims, MASKED,
                    CAUSAL, WINDOWED, SOFTCAP, BIASED, BLOCK_N,
                )  # fmt: skip
        return m_i, l_i, acc

    @triton.jit
    def _attend_rows(
        q_ptr, k_ptr, v_ptr, o_ptr, cu_q_ptr, cu_k_ptr, bias_ptr, seq, block, head, scale_log2,
        window, cap_log2, max_distance,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
        stride_bh,
        GROUP: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
        SOFTCAP: tl.constexpr, BIASED: tl.constexpr, D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOOP_AS_WHILE: tl.constexpr,
    ):  # fmt: skip
        """Rows ``[block * BLOCK_M, +BLOCK_M)`` of request ``seq``'s queries, one head."""
        q_start = tl.load(cu_q_ptr + seq)
        len_q = tl.load(cu_q_ptr + seq + 1) - q_start
        k_start = tl.load(cu_k_ptr + seq)
        len_k = tl.load(cu_k_ptr + seq + 1) - k_start
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, D)
        q = tl.load(
            q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
            mask=(rows < len_q)[:, None],
            other=0.0,
        )
        kv_head = head // GROUP
        k_base = k_ptr + k_start * stride_kt + kv_head * stride_kh
        v_base = v_ptr + k_start * stride_vt + kv_head * stride_vh
        bias_row = bias_ptr + head * stride_bh + max_distance
        # Causal rows see the keys up to their own position (bottom-right: query i of a chunk
        # of len_q sits at key position len_k - len_q + i); bidirectional rows are whole
        # prompts, query i at position i (their keys may be only the first len_k rows).
        positions = rows + (len_k - len_q) if CAUSAL else rows
        # Keys [lo, a) go masked, [a, b) unmasked, [b, hi) masked. Bidirectional rows see every key,
        # so only the last block is masked (10% faster on MiniLM's W1 steps); causal blocks are all
        # masked: splitting their loop measured slower (docs/benchmarks/gpu-short-inputs.md,
        # issue 10); a bidirectional window leaves unmasked the blocks every row of the block sees
        # whole.
        lo = 0
        hi = len_k
        a = 0
        b = 0
        if CAUSAL:
            hi = tl.minimum(len_k, block * BLOCK_M + (len_k - len_q) + BLOCK_M)
            if WINDOWED:
                lo = tl.maximum(0, block * BLOCK_M + (len_k - len_q) - window + 1)
                lo = (lo // BLOCK_N) * BLOCK_N
            a = lo
            b = lo
        elif WINDOWED:
            first = block * BLOCK_M
            last = tl.minimum(first + BLOCK_M, len_q) - 1
            lo = (tl.maximum(0, first - window) // BLOCK_N) * BLOCK_N
            hi = tl.minimum(len_k, first + BLOCK_M + window)
            a = lo + tl.cdiv(tl.maximum(last - window - lo, 0), BLOCK_N) * BLOCK_N
            b = a + (tl.maximum(tl.minimum(first + window + 1, len_k) - a, 0) // BLOCK_N) * BLOCK_N
        else:
            b = (len_k // BLOCK_N) * BLOCK_N
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        m_i, l_i, acc = _attend_span(
            q, k_base, v_base, lo, a, len_k, positions, window, scale_log2, cap_log2, bias_row,
            max_distance, m_i, l_i, acc, stride_kt, stride_vt, dims, True, CAUSAL, WINDOWED,
            SOFTCAP, BIASED, BLOCK_N, LOOP_AS_WHILE,
        )  # fmt: skip
        m_i, l_i, acc = _attend_span(
            q, k_base, v_base, a, b, len_k, positions, window, scale_log2, cap_log2, bias_row,
            max_distance, m_i, l_i, acc, stride_kt, stride_vt, dims, False, CAUSAL, WINDOWED,
            SOFTCAP, BIASED, BLOCK_N, LOOP_AS_WHILE,
        )  # fmt: skip
        m_i, l_i, acc = _attend_span(
            q, k_base, v_base, b, hi, len_k, positions, window, scale_log2, cap_log2, bias_row,
            max_distance, m_i, l_i, acc, stride_kt, stride_vt, dims, True, CAUSAL, WINDOWED,
            SOFTCAP, BIASED, BLOCK_N, LOOP_AS_WHILE,
        )  # fmt: skip
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # rows that saw no key: zeros
        tl.store(
            o_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=(rows < len_q)[:, None],
        )

    @triton.jit
    def _varlen_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        o_ptr,
        cu_q_ptr,
        cu_k_ptr,
        work_ptr,  # WORK_LIST: [1 + 2W]: W, then (request, block of BLOCK_M queries) per item
        scale_log2,  # softmax scale times log2(e): the kernel exponentiates in base 2
        window,  # keys a query may see, itself included; 0: unlimited
        cap_log2,  # SOFTCAP: the cap times log2(e)
        bias_ptr,  # BIASED: [heads, 2 * max_distance + 1] float32, the bias by key - query
        max_distance,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_ot,
        stride_oh,
        stride_bh,
        GROUP: tl.constexpr,  # query heads per KV head
        CAUSAL: tl.constexpr,
        WINDOWED: tl.constexpr,
        SOFTCAP: tl.constexpr,  # scores soft-capped (Gemma2)
        BIASED: tl.constexpr,  # a relative position bias added to the scores (T5, MPNet)
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        WORK_LIST: tl.constexpr,
        LOOP_AS_WHILE: tl.constexpr,
    ):
        if WORK_LIST:
            # Program p takes item p, if there is one: the count is read on the device, so a
            # CUDA graph captured with a fixed grid replays steps of any shape up to it.
            # (A loop over several items a program measured 5-30% slower.)
            item, head = tl.program_id(0), tl.program_id(1)
            if item >= tl.load(work_ptr):
                return
            seq = tl.load(work_ptr + 1 + 2 * item)
            block = tl.load(work_ptr + 2 + 2 * item)
        else:  # grid (query blocks of the longest request, requests, heads)
            block, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
            if block * BLOCK_M >= tl.load(cu_q_ptr + seq + 1) - tl.load(cu_q_ptr + seq):
                return
        _attend_rows(
            q_ptr, k_ptr, v_ptr, o_ptr, cu_q_ptr, cu_k_ptr, bias_ptr, seq, block, head,
            scale_log2, window, cap_log2, max_distance, stride_qt, stride_qh, stride_kt,
            stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_bh, GROUP, CAUSAL,
            WINDOWED, SOFTCAP, BIASED, D, BLOCK_M, BLOCK_N, LOOP_AS_WHILE,
        )  # fmt: skip


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head size: the best of a sweep on an H200 over
# steps of short and of mixed-length requests (benchmarks/attention_kernels.py; 32 re-swept
# with the unmasked blocks of bidirectional steps; 64 and 256 follow their neighbours, unswept).
TILES: dict[int, tuple[int, int, int, int]] = {
    32: (64, 32, 4, 3),
    64: (64, 64, 4, 2),
    128: (64, 64, 4, 3),
    256: (64, 32, 4, 2),
}


def supported(device: torch.device, dtype: torch.dtype, head_dim: int | None = None) -> bool:
    return (
        triton is not None
        and device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and (head_dim is None or head_dim in TILES)
    )


def block_rows(head_dim: int) -> int:
    """Queries one program takes at a time for this head size: the unit of the work list."""
    return TILES[head_dim][0]


def work_list(cu_q: np.ndarray, block_m: int) -> np.ndarray:
    """The kernel's work for one step, int64 ``[1 + 2W]``: W, then (request, query block)
    for each of the W blocks of ``block_m`` queries, from the host's row offsets."""
    lens = np.diff(cu_q)
    blocks = (lens + block_m - 1) // block_m
    total = int(blocks.sum())
    work = np.empty(1 + 2 * total, dtype=np.int64)
    work[0] = total
    work[1::2] = np.repeat(np.arange(len(lens), dtype=np.int64), blocks)
    first = np.cumsum(blocks) - blocks  # each request's first item
    work[2::2] = np.arange(total, dtype=np.int64) - np.repeat(first, blocks)
    return work


def varlen_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [Tk, Hkv, D]
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [R+1] int32
    cu_seqlens_k: torch.Tensor,
    max_q: int,
    *,
    causal: bool,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    tile: tuple[int, int, int, int] | None = None,
    work: torch.Tensor | None = None,
    programs: int = 0,
) -> torch.Tensor:
    """Attention of every request's queries over its keys -> [T, Hq, D], written to ``out``
    where given (any layout with contiguous heads). ``window``: causal, the keys a query sees,
    itself included; bidirectional (whole prompts), the keys on either side of it (key j of
    query i where |i - j| <= window: ModernBERT's local layers). ``softcap``: scores become
    ``softcap * tanh(score / softcap)`` before masking and softmax (Gemma2), None for none.
    ``bias``: [Hq, 2 * M + 1] float32, added to the scaled scores of key j and query i at
    ``bias[:, clamp(j - i, -M, M) + M]`` (T5's and MPNet's relative position bias).

    Two launches. Without ``work``, a grid of (query blocks of the longest request, requests,
    heads) whose surplus programs exit. With ``work`` (``work_list`` of this step, for the
    tile's BLOCK_M, on the device: the runner uploads it with the step's inputs), ``programs``
    programs a head, at least the list's W, each taking one item; a CUDA graph launches a
    fixed ``programs`` for every step it replays (stage/cuda_graphs.py)."""
    num_q, heads, dim = q.shape
    if out is None:
        out = q.new_empty((num_q, heads, dim))
    requests = cu_seqlens_q.shape[0] - 1
    if num_q == 0 or requests == 0:
        return out
    block_m, block_n, warps, stages = tile or TILES[dim]
    for t in (q, k, v, out):
        assert t.stride(-1) == 1, "attention inputs need contiguous heads"
    grid: tuple[int, ...]
    if work is not None:
        assert programs > 0, "a work list comes with its grid size"
        grid = (programs, heads)
    else:
        grid = (triton.cdiv(max(max_q, 1), block_m), requests, heads)
    if bias is not None:
        assert bias.dtype == torch.float32 and bias.shape[0] == heads and bias.stride(1) == 1
    _varlen_attention_kernel[grid](
        q, k, v, out, cu_seqlens_q, cu_seqlens_k, work if work is not None else cu_seqlens_q,
        scale * math.log2(math.e), window or 0, (softcap or 1.0) * math.log2(math.e),
        bias if bias is not None else q, (bias.shape[1] - 1) // 2 if bias is not None else 0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), bias.stride(0) if bias is not None else 0,
        GROUP=heads // k.shape[1], CAUSAL=causal, WINDOWED=window is not None,
        SOFTCAP=softcap is not None, BIASED=bias is not None, D=dim,
        BLOCK_M=block_m, BLOCK_N=block_n, WORK_LIST=work is not None,
        LOOP_AS_WHILE=INTERPRETING, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
