"""Bidirectional attention over a symmetric sliding window, on packed batches of whole prompts
(ModernBERT's local layers).

A query at position i sees the keys j of its own prompt with |i - j| <= ``half_window``: the
mask transformers builds (``create_bidirectional_sliding_window_mask`` with
``config.sliding_window = local_attention // 2``). :func:`.attention.attend` windows only
causal attention (keys behind the query), hence this layer of its own.

On CUDA in fp16/bf16, where the deployment runs a fast attention kernel, the step attends in one
launch: of the Triton kernel (:mod:`.triton_attention`, bidirectional with ``window =
half_window``), where the deployment chose it, from the step's work list, so that the layer
also runs inside a whole-step CUDA graph; else of aten's variable-length flash kernel, whose
window (left, right) = (half_window, half_window) is this mask (each checked against the
portable path once per device and dtype; flash was 70x faster than it on a 16k-token step of
15 requests on an H200). Everywhere else, the portable
path: runs of consecutive equal-length prompts (``grouped_attention.plan_runs``) attend in one
``scaled_dot_product_attention`` call each, on any device and dtype:

- a prompt of at most ``half_window + 1`` tokens lies wholly inside every query's window:
  no mask;
- up to ``_BLOCKED_FROM`` windows long, one dense [L, L] band mask;
- longer, in blocks of ``block`` queries, each against the ``block + 2 * half_window`` keys
  around it, so the work grows with L * window rather than L ** 2 (a local layer of an
  8192-token prompt with a 128-token window would otherwise cost as much as a global one).

With key lengths (``AttentionMetadata.key_rows``: a prompt's keys are its first ``key_len``
tokens, ColBERT's query expansion) a query sees the keys of its window that are among them,
as transformers' sliding-window mask combined with the attention mask; a query that sees none
gets zeros, as torch's attention gives a row whose boolean mask is all false. Such steps take
the portable path: the flash kernel aligns a window to the last key, not to the query's own
position.

Flash and the portable path read the step's offsets and longest prompt from the host, so
they cannot be captured in a CUDA graph: under capture they raise, and the graph runner
(``stage/cuda_graphs.py``) then runs the stage eagerly.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from . import triton_attention
from .attention import AttentionMetadata, flash_supported
from .grouped_attention import Run, plan_runs

# Prompts longer than this many window widths (2 * half_window) attend in blocks.
_BLOCKED_FROM = 4


def windowed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    half_window: int,
    kernel: str = "portable",
) -> torch.Tensor:
    """q/k/v: [T, H, D] (row-strided views allowed) of whole prompts, no KV cache -> [T, H, D]
    contiguous; keys are q's rows (``meta.key_rows`` only says which of them are keys).
    ``kernel``: the deployment's attention kernel; any but "portable" lets a CUDA step in half
    precision without key lengths take the Triton kernel ("triton") or flash (the others)."""
    assert not meta.causal and meta.prefix_slots is None, "whole bidirectional prompts only"
    if (
        kernel == "triton"
        and meta.key_rows is None
        and _triton_agrees(q.device, q.dtype, q.shape[-1])
    ):
        return _triton(q, k, v, meta, scale, half_window)
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "symmetric sliding-window attention reads each step's prompt offsets on the host "
            "and cannot be captured in a CUDA graph"
        )
    if kernel != "portable" and meta.key_rows is None and _flash_agrees(q.device, q.dtype):
        return _flash(q, k, v, meta, scale, half_window)
    return _portable(q, k, v, meta, scale, half_window)


def _portable(q, k, v, meta: AttentionMetadata, scale: float, half_window: int) -> torch.Tensor:
    if meta.group_plan is None:  # the same plan attend() makes (and shares) on the CPU
        meta.group_plan = plan_runs(meta.cu_q_host, meta.cu_k_host, causal=False)
    outs = [_attend_run(q, k, v, run, scale, half_window) for run in meta.group_plan.runs]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _attend_run(q, k, v, run: Run, scale: float, w: int) -> torch.Tensor:
    # Keys are the run's own rows, of which the first len_k of each prompt are keys (all of
    # them unless the step has key lengths): its rows in the packed K/V are not read.
    n, length, keys = run.size, run.len_q, run.len_k
    rows = slice(run.q_row, run.q_row + n * length)
    hq, d = q.shape[1], q.shape[2]
    qg, kg, vg = (x[rows].view(n, length, x.shape[1], d) for x in (q, k, v))  # [n, L, H, D]
    if length <= max(w + 1, _BLOCKED_FROM * 2 * w):
        mask = None if length <= w + 1 and keys == length else _band(length, w, keys, q.device)
        out = _sdpa(qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2), mask, scale)
        out = out.transpose(1, 2)  # [n, L, H, D]
    else:
        out = _blocked(qg, kg, vg, scale, w, keys)
    return out.reshape(n * length, hq, d)


def _blocked(qg, kg, vg, scale: float, w: int, keys: int) -> torch.Tensor:
    """[n, L, H, D] -> [n, L, H, D]: query block b (rows b*B .. b*B+B-1) against the keys
    b*B - w .. b*B+B+w-1, zero-padded past both ends and masked there (and from ``keys`` on)."""
    n, length, hq, d = qg.shape
    block = max(16, 2 * w)
    nb = -(-length // block)
    padded = nb * block
    qp = F.pad(qg, (0, 0, 0, 0, 0, padded - length))  # [n, Lp, H, D]
    qb = qp.view(n * nb, block, hq, d).transpose(1, 2)  # [n*nb, H, B, D]
    span = block + 2 * w

    def windows(x: torch.Tensor) -> torch.Tensor:
        xp = F.pad(x, (0, 0, 0, 0, w, padded - length + w))  # [n, Lp + 2w, Hkv, D]
        xw = xp.unfold(1, span, block)  # [n, nb, Hkv, D, span]
        return xw.permute(0, 1, 2, 4, 3).reshape(n * nb, x.shape[2], span, d)

    mask = _block_mask(nb, block, w, length, keys, qg.device).repeat(n, 1, 1, 1)  # [n*nb,1,B,S]
    out = _sdpa(qb, windows(kg), windows(vg), mask, scale)  # [n*nb, H, B, D]
    return out.transpose(1, 2).reshape(n, padded, hq, d)[:, :length]


def _sdpa(q, k, v, mask, scale: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[-3] != k.shape[-3]
    )


def _band(length: int, w: int, keys: int, device: torch.device) -> torch.Tensor:
    """[L, L] boolean, True where |i - j| <= w and key j is one of the first ``keys``."""
    i = torch.arange(length, device=device)
    return ((i[:, None] - i[None, :]).abs() <= w) & (i[None, :] < keys)


def _block_mask(
    nb: int, block: int, w: int, length: int, keys: int, device: torch.device
) -> torch.Tensor:
    """[nb, 1, B, B + 2w] boolean: query b*B + i may see key b*B - w + j when both are within
    w of each other and the key is a real one (0 <= key < ``keys`` <= L). Padding queries
    (past L) see every real key of their block, so that no row is all masked where the keys
    are all real (they are discarded)."""
    i = torch.arange(block, device=device)[:, None]
    j = torch.arange(block + 2 * w, device=device)[None, :]
    base = torch.arange(nb, device=device)[:, None, None] * block
    key = base + j - w  # [nb, 1, S]
    real_key = (key >= 0) & (key < keys)
    near = ((j - i) >= 0) & ((j - i) <= 2 * w)  # |(b*B + i) - (b*B - w + j)| <= w
    pad_query = (base + i) >= length  # [nb, B, 1]
    return ((near | pad_query) & real_key).unsqueeze(1)


def _flash(q, k, v, meta: AttentionMetadata, scale: float, w: int) -> torch.Tensor:
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_q, meta.max_k, 0.0, False, False,
        scale=scale, window_size_left=w, window_size_right=w,
    )  # fmt: skip
    return out[0]


def _triton(q, k, v, meta: AttentionMetadata, scale: float, w: int) -> torch.Tensor:
    return triton_attention.varlen_attention(
        q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_q, causal=False, scale=scale,
        window=w, work=meta.work, programs=meta.work_programs,
    )  # fmt: skip


@functools.cache
def _flash_agrees(device: torch.device, dtype: torch.dtype) -> bool:
    return flash_supported(device, dtype) and _agrees(_flash, "flash", device, dtype, 64)


@functools.cache
def _triton_agrees(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    if not triton_attention.supported(device, dtype, head_dim):
        return False
    return _agrees(_triton, "triton", device, dtype, head_dim)


def _agrees(attend, name: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ``attend`` runs here and gives the portable path's result on a small batch
    that takes each of the portable path's ways (no mask, band, blocks)."""
    cu = np.array([0, 5, 45, 175, 180])
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(180, 2, head_dim, device=device, dtype=dtype, generator=gen) for _ in "qkv"
    )
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    meta = AttentionMetadata(False, cu_t, cu_t, 130, 130, cu, cu, total_k=180)
    try:
        got = attend(q, k, v, meta, 0.125, 8).float()
    except Exception as exc:  # a torch without the op's window arguments, a missing kernel
        warnings.warn(f"{name} kernel unusable for windowed attention: {exc}", stacklevel=2)
        return False
    want = _portable(q.float(), k.float(), v.float(), meta, 0.125, 8)
    if torch.allclose(got, want, rtol=2e-2, atol=2e-2):
        return True
    warnings.warn(f"{name} kernel disagrees with windowed attention; not used", stacklevel=2)
    return False
