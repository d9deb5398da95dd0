"""Batch- and chunk-invariant attention for the CPU (``EngineConfig.batch_invariant``).

A query row's output here depends on its own query, its request's keys up to the ones it may
see, and nothing else: not the other requests of the step, nor how its prompt was cut into
chunks across steps. The same row always takes the same path:

- keys in fixed blocks of ``KEY_BLOCK`` from position 0, combined by an online softmax
  (running max, rescaled sum and accumulator), block after block in order; a block the row
  may not see at all (past its position in a causal chunk) changes nothing, bit for bit:
  its scores are -inf, so the max stays, the rescale factor is exp(0) = 1 and the additions
  are of zeros;
- queries in fixed tiles of ``QUERY_TILE`` rows (the last padded), so that every score and
  every weighted sum is one ``[QUERY_TILE, D] x [D, KEY_BLOCK]`` or
  ``[QUERY_TILE, KEY_BLOCK] x [KEY_BLOCK, D]`` product of a batched GEMM, each of which the
  library computes as the same fixed-shape problem (``invariant_ops`` says why shapes matter);
- consecutive requests with the same query and key lengths share the batched calls (a batch
  entry is computed alone, so this changes no bits), the others go one run at a time.

The GPU needs none of this: the Triton varlen kernel (``triton_attention``) already walks keys
in fixed blocks from 0 per query block, with tiles chosen by head size alone.
"""

from __future__ import annotations

import numpy as np
import torch

from .grouped_attention import plan_runs
from .invariant_ops import fixed_shapes

KEY_BLOCK = 64
QUERY_TILE = 16


def invariant_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: np.ndarray,
    cu_k: np.ndarray,
    *,
    causal: bool,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """q: [T, Hq, D]; k/v: [Tk, Hkv, D], each request's keys ``[0, len_k)`` packed at
    ``cu_k`` (causal: its chunk is the last ``len_q`` of them) -> [T, Hq, D]."""
    if window is not None and not causal:
        raise ValueError("batch-invariant attention: bidirectional windows are not supported")
    with fixed_shapes():
        return _attend_runs(q, k, v, cu_q, cu_k, causal=causal, scale=scale, window=window)


def _attend_runs(q, k, v, cu_q, cu_k, *, causal: bool, scale: float, window: int | None):
    out = torch.empty_like(q)
    for run in plan_runs(cu_q, cu_k, causal).runs:
        q_rows = q[run.q_row : run.q_row + run.size * run.len_q]
        k_rows = k[run.k_row : run.k_row + run.size * run.len_k]
        v_rows = v[run.k_row : run.k_row + run.size * run.len_k]
        o = _attend_run(
            q_rows.reshape(run.size, run.len_q, *q.shape[1:]),
            k_rows.reshape(run.size, run.len_k, *k.shape[1:]),
            v_rows.reshape(run.size, run.len_k, *v.shape[1:]),
            causal=causal, scale=scale, window=window,
        )  # fmt: skip
        out[run.q_row : run.q_row + run.size * run.len_q] = o.reshape(-1, *q.shape[1:])
    return out


def _attend_run(
    q: torch.Tensor,  # [n, lq, Hq, D]
    k: torch.Tensor,  # [n, lk, Hkv, D]
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    n, lq, hq, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    tiles = -(-lq // QUERY_TILE)
    blocks = -(-lk // KEY_BLOCK)
    # [n, Hq, tiles, QUERY_TILE, D]: zero rows pad the last tile (their outputs are dropped).
    qp = q.new_zeros((n, tiles * QUERY_TILE, hq, d))
    qp[:, :lq] = q
    qt = qp.permute(0, 2, 1, 3).reshape(n, hq, tiles, QUERY_TILE, d)
    # [n, Hq, blocks * KEY_BLOCK, D], each query head with its KV head's rows (GQA).
    group = hq // hkv
    kp = k.new_zeros((n, blocks * KEY_BLOCK, hkv, d))
    vp = v.new_zeros((n, blocks * KEY_BLOCK, hkv, d))
    kp[:, :lk], vp[:, :lk] = k, v
    kh = kp.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    vh = vp.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    # Causal: query i of the chunk sits at key position lk - lq + i; bidirectional: at i.
    positions = torch.arange(tiles * QUERY_TILE) + (lk - lq if causal else 0)
    positions = positions.view(tiles, QUERY_TILE, 1)
    m = q.new_full((n, hq, tiles, QUERY_TILE, 1), float("-inf"))
    denom = q.new_zeros((n, hq, tiles, QUERY_TILE, 1))
    acc = q.new_zeros((n, hq, tiles, QUERY_TILE, d))
    for b in range(blocks):
        cols = torch.arange(b * KEY_BLOCK, (b + 1) * KEY_BLOCK)
        kb = kh[:, :, b * KEY_BLOCK : (b + 1) * KEY_BLOCK].unsqueeze(2)  # [n, Hq, 1, B, D]
        vb = vh[:, :, b * KEY_BLOCK : (b + 1) * KEY_BLOCK].unsqueeze(2)
        s = torch.matmul(qt, kb.transpose(-1, -2)) * scale  # [n, Hq, tiles, QT, B]
        visible = (cols < lk).view(1, 1, KEY_BLOCK)
        if causal:
            visible = visible & (cols.view(1, 1, -1) <= positions)
            if window is not None:
                visible = visible & (cols.view(1, 1, -1) > positions - window)
        s = s.masked_fill(~visible, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        # A row that has seen no key yet keeps a finite reference (padding rows, windows).
        m_new = m_new.masked_fill(m_new == float("-inf"), 0.0)
        p = torch.exp(s - m_new)
        alpha = torch.exp(m - m_new)
        denom = denom * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, vb)
        m = m_new
    out = acc / denom.masked_fill(denom == 0, 1.0)
    # [n, Hq, tiles * QT, D] -> [n, lq, Hq, D]
    out = out.reshape(n, hq, tiles * QUERY_TILE, d)[:, :, :lq]
    return out.permute(0, 2, 1, 3)
