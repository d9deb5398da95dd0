"""Tiles for running a step on the CPU with its activations in cache.

A step of up to ``max_num_batched_tokens`` (16k by default) tokens makes every intermediate
of a layer tens of MB: the element-wise ops (GELU, LayerNorm, residual adds) and even the wide
projections become memory-bound. Encoder requests do not interact, so the CPU runs a step as
tiles of a few thousand tokens through all of its layers, each tile's activations staying in
cache. Sorting by length first makes equal lengths neighbours, so attention runs as few long
groups of equal-length requests (:mod:`.grouped_attention`). With several intra-op threads
the tiles run side by side, one per single-threaded lane (:mod:`.cpu_lanes`). Decoders (KV
cache, chunks) keep the step whole for attention and run only the per-token MLP block in row
tiles.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .attention import AttentionMetadata, prefix_key_rows
from .cpu_lanes import MIN_LANE_TOKENS

# Tokens per tile: measured on 2 Sapphire Rapids cores with all-MiniLM-L6-v2 (hidden 384,
# intermediate 1536) - throughput was flat from 1k to 4k tokens and fell at 8k and beyond.
CPU_TILE_TOKENS = 2048
# Rows per tile of a decoder's MLP block: a Qwen3-0.6B-shaped block (hidden 1024, gate|up 6144
# wide) on 8k rows ran 10% faster in tiles of 512-1024 rows than whole (1 core, torch 2.13).
CPU_MLP_TILE_ROWS = 1024


@dataclass(frozen=True)
class Tile:
    """A cache-sized piece of a CPU step: some of its requests, computed together; the
    stage writes each tile's outputs back to the step's rows ``rows``."""

    rows: torch.Tensor  # [n] rows of the step (packed order) that this tile computes, in order
    meta: AttentionMetadata  # the tile's requests as a packed batch of their own


def plan_tiles(
    cu_q: np.ndarray,
    tile_tokens: int | None = None,
    key_lens: np.ndarray | None = None,
    lanes: int = 1,
) -> list[Tile]:
    """Whole-prompt requests (bidirectional, no cache) sorted by length, longest first, cut
    into tiles of at most about ``tile_tokens`` (default CPU_TILE_TOKENS) tokens: the sorted
    step is cut into equal spans, and a tile takes every request that starts within its span
    (so a request longer than a span makes a tile of its own). ``key_lens``: each request's
    keys are its first ``key_lens`` tokens (``AttentionMetadata.key_lens``); None: all.
    ``lanes``: tiles computed side by side (``cpu_lanes``): their number a multiple of it,
    where each lane gets at least ``MIN_LANE_TOKENS``, so that every lane gets as much work."""
    tile_tokens = tile_tokens or CPU_TILE_TOKENS
    lens = np.diff(cu_q)
    if not len(lens):
        return []
    order = np.argsort(-lens, kind="stable")
    lens_sorted = lens[order]
    ends = np.cumsum(lens_sorted)
    begins = ends - lens_sorted
    # Equal spans (no short last tile, where a GEMM of a few hundred rows is less efficient).
    total = int(ends[-1])
    count = -(-total // tile_tokens)
    if lanes > 1 and total >= lanes * MIN_LANE_TOKENS:
        count = -(-count // lanes) * lanes
    span = -(-total // count)
    # Request i of the sorted order starts at token begins[i] of the sorted step.
    rows = np.repeat(cu_q[order] - begins, lens_sorted) + np.arange(int(cu_q[-1]))
    tile_of = begins // span
    cuts = np.flatnonzero(np.diff(tile_of)) + 1
    tiles = []
    for a, b in zip(np.concatenate(([0], cuts)), np.concatenate((cuts, [len(order)])), strict=True):
        cu = np.concatenate(([0], ends[a:b] - begins[a])).astype(np.int64)
        keys = key_lens[order[a:b]] if key_lens is not None else None
        tiles.append(Tile(torch.from_numpy(rows[begins[a] : ends[b - 1]]), _meta(cu, keys)))
    return tiles


def _meta(cu: np.ndarray, key_lens: np.ndarray | None) -> AttentionMetadata:
    cu32 = torch.from_numpy(cu.astype(np.int32))
    longest = int(np.diff(cu).max())
    if key_lens is None:
        return AttentionMetadata(
            causal=False,
            cu_seqlens_q=cu32,
            cu_seqlens_k=cu32,
            max_q=longest,
            max_k=longest,
            cu_q_host=cu,
            cu_k_host=cu,
            total_k=int(cu[-1]),
        )
    cu_k, key_rows = prefix_key_rows(cu, key_lens)
    return AttentionMetadata(
        causal=False,
        cu_seqlens_q=cu32,
        cu_seqlens_k=torch.from_numpy(cu_k.astype(np.int32)),
        max_q=longest,
        max_k=int(key_lens.max()),
        cu_q_host=cu,
        cu_k_host=cu_k,
        total_k=int(cu_k[-1]),
        key_rows=torch.from_numpy(key_rows),
    )


def in_row_tiles(
    fn: Callable[..., torch.Tensor], *row_args: torch.Tensor, rows: int | None = None
) -> torch.Tensor:
    """``fn(*row_args)`` for a row-wise ``fn`` (each output row depends only on the same rows
    of the inputs), computed ``rows`` (default CPU_MLP_TILE_ROWS) rows at a time."""
    rows = rows or CPU_MLP_TILE_ROWS
    total = row_args[0].shape[0]
    if total <= rows:
        return fn(*row_args)
    first = fn(*(a[:rows] for a in row_args))
    out = first.new_empty((total, *first.shape[1:]))
    out[:rows] = first
    for start in range(rows, total, rows):
        out[start : start + rows] = fn(*(a[start : start + rows] for a in row_args))
    return out
