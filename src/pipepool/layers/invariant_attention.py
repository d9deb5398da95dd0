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
- every query tile of the step goes through one batched call per key block (a batch entry is
  computed alone, as the same fixed-shape GEMM, so sharing the call changes no bits); a tile
  whose request has fewer key blocks than the step's longest sees only masked blocks there.

The GPU needs none of this: the Triton varlen kernel (``triton_attention``) already walks keys
in fixed blocks from 0 per query block, with tiles chosen by head size alone.
"""

from __future__ import annotations

import numpy as np
import torch

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
        return _attend(q, k, v, _Tiles.of(cu_q, cu_k, causal), scale=scale, window=window)


class _Tiles:
    """The step's query tiles (host arrays): for each, its request's row offsets and lengths
    and its first query's index in the request."""

    def __init__(self, req: np.ndarray, first: np.ndarray, cu_q, cu_k, causal: bool) -> None:
        lq, lk = np.diff(cu_q)[req], np.diff(cu_k)[req]
        self.count = len(req)
        self.blocks = int(-(-lk.max() // KEY_BLOCK)) if len(req) else 0
        offs = np.arange(QUERY_TILE)
        index = first[:, None] + offs[None, :]  # [tiles, QT]: query index in its request
        self.q_valid = index < lq[:, None]
        self.q_rows = np.where(self.q_valid, cu_q[req][:, None] + index, -1)
        # A query's key position: causal, its chunk is the last lq of its lk keys.
        self.positions = index + ((lk - lq)[:, None] if causal else 0)
        self.k_start, self.len_k = cu_k[req], lk
        self.causal = causal

    @classmethod
    def of(cls, cu_q: np.ndarray, cu_k: np.ndarray, causal: bool) -> _Tiles:
        tiles = -(-np.diff(cu_q) // QUERY_TILE)
        req = np.repeat(np.arange(len(tiles)), tiles)
        starts = np.cumsum(tiles) - tiles
        first = (np.arange(int(tiles.sum())) - np.repeat(starts, tiles)) * QUERY_TILE
        return cls(req, first, cu_q, cu_k, causal)


def _gather(x: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    """x[rows] with -1 as a zero row: [*rows.shape, H, D]."""
    padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
    index = torch.from_numpy(np.where(rows < 0, x.shape[0], rows).reshape(-1))
    return padded.index_select(0, index).view(*rows.shape, *x.shape[1:])


def _attend(q, k, v, tiles: _Tiles, *, scale: float, window: int | None) -> torch.Tensor:
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    group = hq // hkv
    n = tiles.count
    # [tiles, Hkv, group * QT, D]: a KV head's query heads stacked, so K/V are never repeated.
    qt = _gather(q, tiles.q_rows).view(n, QUERY_TILE, hkv, group, d)
    qt = qt.permute(0, 2, 3, 1, 4).reshape(n, hkv, group * QUERY_TILE, d)
    # K/V head-major with a zero row at the end of each head (index -1's target), so each
    # block is one gather, already in the [tiles, Hkv, B, D] layout the products read.
    kh, vh = (_head_major(x) for x in (k, v))
    m = q.new_full((n, hkv, group * QUERY_TILE, 1), float("-inf"))
    denom = q.new_zeros((n, hkv, group * QUERY_TILE, 1))
    acc = q.new_zeros((n, hkv, group * QUERY_TILE, d))
    # Blocks past a tile's keys would change nothing (all masked): only the tiles whose
    # request has keys there take part in a block (a smaller batch of the same products).
    tile_blocks = -(-tiles.len_k // KEY_BLOCK)
    for b in range(tiles.blocks):
        part = np.flatnonzero(tile_blocks > b)
        whole = len(part) == n
        sel = torch.from_numpy(part)
        state = (m, denom, acc) if whole else (m[sel], denom[sel], acc[sel])
        step = _block(qt if whole else qt[sel], kh, vh, tiles, part, b, state, scale, window, group)
        if whole:
            m, denom, acc = step
        else:
            m[sel], denom[sel], acc[sel] = step
    out = acc / denom.masked_fill(denom == 0, 1.0)
    # [tiles, Hkv, G, QT, D] -> rows of the step, [T, Hq, D]
    out = out.view(n, hkv, group, QUERY_TILE, d).permute(0, 3, 1, 2, 4).reshape(-1, hq, d)
    keep = torch.from_numpy(np.flatnonzero(tiles.q_valid.reshape(-1)))
    result = q.new_empty(q.shape)
    result[torch.from_numpy(tiles.q_rows.reshape(-1)[keep.numpy()])] = out.index_select(0, keep)
    return result


def _head_major(x: torch.Tensor) -> torch.Tensor:
    """[Tk, H, D] -> [H * (Tk + 1), D]: head h's rows at h * (Tk + 1), then a zero row."""
    t, h, d = x.shape
    out = x.new_zeros((h, t + 1, d))
    out[:, :t] = x.transpose(0, 1)
    return out.view(h * (t + 1), d)


def _gather_block(xh: torch.Tensor, rows: np.ndarray, heads: int) -> torch.Tensor:
    """Rows ``rows`` [tiles, B] (-1: the zero row) of every head of a ``_head_major`` tensor
    -> [tiles, heads, B, D], contiguous."""
    per_head = xh.shape[0] // heads
    local = np.where(rows < 0, per_head - 1, rows)
    index = local[:, None, :] + (np.arange(heads) * per_head)[None, :, None]
    flat = torch.from_numpy(index.reshape(-1))
    return xh.index_select(0, flat).view(*index.shape, xh.shape[1])


def _block(qt, kh, vh, tiles: _Tiles, part: np.ndarray, b: int, state, scale, window, group):
    """One key block's online-softmax update of the tiles ``part``: (m, denom, acc) after."""
    m, denom, acc = state
    hkv = qt.shape[1]
    cols = b * KEY_BLOCK + np.arange(KEY_BLOCK)
    inside = cols[None, :] < tiles.len_k[part, None]  # [tiles, B]
    rows = np.where(inside, tiles.k_start[part, None] + cols[None, :], -1)
    kb = _gather_block(kh, rows, hkv).transpose(-1, -2)  # [tiles, Hkv, D, B]
    vb = _gather_block(vh, rows, hkv)  # [tiles, Hkv, B, D]
    visible = np.broadcast_to(inside[:, None, :], (len(part), QUERY_TILE, KEY_BLOCK))
    if tiles.causal:
        positions = tiles.positions[part, :, None]  # [tiles, QT, 1]
        visible = visible & (cols[None, None, :] <= positions)
        if window is not None:
            visible = visible & (cols[None, None, :] > positions - window)
    hidden = torch.from_numpy(~np.tile(visible, (1, group, 1)))[:, None]  # [tiles, 1, G*QT, B]
    s = torch.matmul(qt, kb) * scale  # [tiles, Hkv, G * QT, B]
    s = s.masked_fill(hidden, float("-inf"))
    m_new = torch.maximum(m, s.amax(-1, keepdim=True))
    # A row that has seen no key yet keeps a finite reference (padding rows, windows).
    m_new = m_new.masked_fill(m_new == float("-inf"), 0.0)
    p = torch.exp(s - m_new)
    alpha = torch.exp(m - m_new)
    return m_new, denom * alpha + p.sum(-1, keepdim=True), acc * alpha + torch.matmul(p, vb)
