"""Bidirectional attention with an additive bias on the scores (a relative position bias, as
MPNet and T5 add), over a packed batch of whole prompts, on any device.

The fast kernels behind :func:`.attention.attend` (Triton, flash) take no bias, so this is a
path of its own: each run of consecutive equal-length requests attends in one
``scaled_dot_product_attention`` call on ``[n, H, L, D]`` views of the packed q/k/v, with the
length's ``[H, L, L]`` bias as the float mask, broadcast over the run's requests (on the CPU an
encoder step is sorted by length, so a step is a few long runs). Queries and keys are the same
tokens: encoders attend over whole prompts, with no KV cache and no chunks.

Nothing here is captured into CUDA graphs: the runs are read from the step's host-side
offsets, which a graph would freeze at the values of its capture.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .attention import AttentionMetadata
from .grouped_attention import plan_runs


def relative_position_bucket(
    relative: torch.Tensor, num_buckets: int = 32, max_distance: int = 128
) -> torch.Tensor:
    """T5's bidirectional bucket of each key-minus-query distance (int64 in, int64 out), op for
    op as transformers' MPNet computes it: half the buckets per direction, distances below a
    quarter of ``num_buckets`` exact, logarithmic up to ``max_distance``, the last bucket of
    each direction beyond. The float steps (log, truncation) are the reference's own, so a
    distance on a bucket boundary lands where it lands there."""
    n = -relative
    half = num_buckets // 2
    ret = (n < 0).to(torch.long) * half
    n = torch.abs(n)
    max_exact = half // 2
    is_small = n < max_exact
    val_if_large = max_exact + (
        torch.log(n.float() / max_exact) / math.log(max_distance / max_exact) * (half - max_exact)
    ).to(torch.long)
    val_if_large = torch.min(val_if_large, torch.full_like(val_if_large, half - 1))
    return ret + torch.where(is_small, n, val_if_large)


class LengthBias:
    """The bias of one step, by request length: ``self(L)`` is ``[H, L, L]`` (query rows, key
    columns) in the table's dtype, computed on first use and shared by every layer of the
    stage (the bias depends on positions only, and an encoder's prompts start at 0).

    ``table``: ``[num_buckets, H]``; ``bucket_of_distance``: ``[2M - 1]`` int64, the bucket of
    key-minus-query distance ``d`` at index ``d + M - 1``, for prompts of up to M tokens."""

    def __init__(self, table: torch.Tensor, bucket_of_distance: torch.Tensor) -> None:
        self.table, self.buckets = table, bucket_of_distance
        self.max_len = (bucket_of_distance.shape[0] + 1) // 2
        self._by_length: dict[int, torch.Tensor] = {}

    def __call__(self, length: int) -> torch.Tensor:
        bias = self._by_length.get(length)
        if bias is None:
            assert length <= self.max_len, (length, self.max_len)
            pos = torch.arange(length, device=self.table.device)
            distance = pos[None, :] - pos[:, None] + (self.max_len - 1)  # [L, L] key - query
            bias = self.table[self.buckets[distance]].permute(2, 0, 1)  # [H, L, L]
            self._by_length[length] = bias
        return bias


def biased_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    bias: Callable[[int], torch.Tensor],
    *,
    scale: float,
) -> torch.Tensor:
    """softmax(q kᵀ · scale + bias) v per request. q/k/v: [T, H, D] packed whole prompts (may
    be strided views of one fused projection); ``bias(L)``: [H, L, L] for a request of L
    tokens, in q's dtype -> [T, H, D] contiguous."""
    if meta.graph_split is not None:
        raise RuntimeError("attention with a score bias runs eagerly, outside CUDA graphs")
    assert not meta.causal and meta.prefix_slots is None, "whole prompts only (an encoder)"
    if meta.group_plan is None:
        meta.group_plan = plan_runs(meta.cu_q_host, meta.cu_k_host, causal=False)
    heads, dim = q.shape[1], q.shape[2]
    outs = []
    for run in meta.group_plan.runs:
        n, length = run.size, run.len_q
        rows = slice(run.q_row, run.q_row + n * length)
        # [n, H, L, D] views of the run's rows: splitting the token dimension needs no copy.
        qg, kg, vg = (x[rows].view(n, length, heads, dim).transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=bias(length), scale=scale)
        outs.append(out.transpose(1, 2).reshape(n * length, heads, dim))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
