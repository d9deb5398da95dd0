"""DeBERTa's disentangled self-attention over a packed batch of whole prompts, on any device.

Scores are content-to-content plus, where the checkpoint asks, content-to-position (c2p) and
position-to-content (p2c) terms read from a table of relative-position embeddings:

    score[q, k] = (q_q · k_k + q_q · pos_key[c2p(q - k)] + k_k · pos_query[p2c(q - k)]) * scale

where ``c2p`` and ``p2c`` map a query-minus-key distance to a row of the table: the distance
(log-bucketed beyond half the buckets when ``position_buckets`` > 0) shifted by the table's
half-span and clamped into it, exactly as transformers' ``DisentangledSelfAttention`` gathers
them. The two position terms depend on the content of each request, so unlike a plain bias
they cannot be shared across requests: each run of consecutive equal-length requests
(``grouped_attention.plan_runs``) computes its ``[n, H, L, L]`` terms by one matmul against the
table and one gather, then attends in one ``scaled_dot_product_attention`` call with them as
the float mask. Queries and keys are the same tokens: encoders attend over whole prompts.

Nothing here is captured into CUDA graphs: the runs are read from the step's host offsets.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .attention import AttentionMetadata
from .grouped_attention import plan_runs


def log_bucket_position(
    relative: torch.Tensor, bucket_size: int, max_position: int
) -> torch.Tensor:
    """transformers' ``make_log_bucket_position``, op for op (int64 in, float out): distances
    within half the buckets kept, larger ones log-bucketed up to ``max_position``. The float
    steps are the reference's own, so a distance on a bucket boundary lands where it does
    there."""
    sign = torch.sign(relative)
    mid = bucket_size // 2
    abs_pos = torch.where(
        (relative < mid) & (relative > -mid),
        torch.tensor(mid - 1).type_as(relative),
        torch.abs(relative),
    )
    log_pos = (
        torch.ceil(
            torch.log(abs_pos / mid) / torch.log(torch.tensor((max_position - 1) / mid)) * (mid - 1)
        )
        + mid
    )
    return torch.where(abs_pos <= mid, relative.type_as(log_pos), log_pos * sign)


def relative_index_tables(
    max_len: int, span: int, buckets: int, max_relative: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The table rows the c2p and p2c terms read, by query-minus-key distance d at index
    d + max_len - 1 (int64, on the CPU as transformers computes them). ``span``: half the
    table's rows; ``buckets`` > 0 log-buckets distances (then ``max_relative`` is the largest
    one the buckets reach)."""
    distance = torch.arange(1 - max_len, max_len)  # q - k
    bucketed = distance
    if buckets > 0 and max_relative > 0:
        bucketed = log_bucket_position(distance, buckets, max_relative)
    bucketed = bucketed.to(torch.long)
    c2p = torch.clamp(bucketed + span, 0, 2 * span - 1)
    # transformers gathers p2c by the *key-minus-query* bucket r(k - q) and transposes:
    # row -r(k - q) + span. Stored by q - k, that is the reversed sequence.
    p2c = torch.clamp(-bucketed.flip(0) + span, 0, 2 * span - 1)
    return c2p, p2c


class RelativeIndex:
    """One step's ``[L, L]`` table-row indices by request length (query rows, key columns),
    built on first use and shared by every layer of the stage (they depend on positions only,
    and an encoder's prompts start at 0). ``c2p_rows``/``p2c_rows``: [2M - 1] int64 from
    :func:`relative_index_tables` (on the model's device)."""

    def __init__(self, c2p_rows: torch.Tensor, p2c_rows: torch.Tensor) -> None:
        self.c2p_rows, self.p2c_rows = c2p_rows, p2c_rows
        self.max_len = (c2p_rows.shape[0] + 1) // 2
        self._by_length: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        found = self._by_length.get(length)
        if found is None:
            assert length <= self.max_len, (length, self.max_len)
            pos = torch.arange(length, device=self.c2p_rows.device)
            distance = pos[:, None] - pos[None, :] + (self.max_len - 1)  # [L, L] q - k
            found = (self.c2p_rows[distance], self.p2c_rows[distance])
            self._by_length[length] = found
        return found


class PositionTerms(NamedTuple):
    """A layer's position projections of the (normed) relative embeddings: ``[H, 2S, D]``
    each, None where its term is not computed, and the step's :class:`RelativeIndex`."""

    pos_key: torch.Tensor | None  # c2p
    pos_query: torch.Tensor | None  # p2c
    rows: RelativeIndex  # not ``index``: that would shadow tuple.index


def _position_bias(
    qg: torch.Tensor, kg: torch.Tensor, terms: PositionTerms, length: int
) -> torch.Tensor | None:
    """The c2p + p2c terms of one run: qg/kg [n, H, L, D] -> [n, H, L, L] (unscaled)."""
    c2p_idx, p2c_idx = terms.rows(length)
    bias = None
    if terms.pos_key is not None:
        c2p = torch.matmul(qg, terms.pos_key.transpose(-1, -2))  # [n, H, Lq, 2S]
        bias = torch.gather(c2p, -1, c2p_idx.expand(*c2p.shape[:2], length, length))
    if terms.pos_query is not None:
        # Key k's scores against every table row, as columns: [n, H, 2S, Lk]; then entry
        # (q, k) reads row p2c_idx[q, k] of column k (a gather down the rows), which lays the
        # term out as [n, H, Lq, Lk] directly, contiguous (a float mask the CUDA kernels take).
        p2c = torch.matmul(terms.pos_query, kg.transpose(-1, -2))
        p2c = torch.gather(p2c, -2, p2c_idx.expand(*p2c.shape[:2], length, length))
        bias = p2c if bias is None else bias + p2c
    return bias


def disentangled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    terms: PositionTerms | None,
    *,
    scale_factor: int,
) -> torch.Tensor:
    """softmax((q kᵀ + c2p + p2c) / sqrt(D · scale_factor)) v per request. q/k/v: [T, H, D]
    packed whole prompts (may be strided views of one fused projection); ``terms``: None
    without relative attention -> [T, H, D] contiguous."""
    if meta.graph_split is not None:
        raise RuntimeError("disentangled attention runs eagerly, outside CUDA graphs")
    assert not meta.causal and meta.prefix_slots is None, "whole prompts only (an encoder)"
    assert meta.key_rows is None, "every token a key (the stage refuses key lengths here)"
    if meta.group_plan is None:
        meta.group_plan = plan_runs(meta.cu_q_host, meta.cu_k_host, causal=False)
    heads, dim = q.shape[1], q.shape[2]
    scale = 1.0 / math.sqrt(dim * scale_factor)
    outs = []
    for run in meta.group_plan.runs:
        n, length = run.size, run.len_q
        rows = slice(run.q_row, run.q_row + n * length)
        # [n, H, L, D] views of the run's rows: splitting the token dimension needs no copy.
        qg, kg, vg = (x[rows].view(n, length, heads, dim).transpose(1, 2) for x in (q, k, v))
        bias = _position_bias(qg, kg, terms, length) if terms is not None else None
        if bias is not None:
            bias = bias * scale  # the reference divides each term by the same sqrt
        out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=bias, scale=scale)
        outs.append(out.transpose(1, 2).reshape(n * length, heads, dim))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
