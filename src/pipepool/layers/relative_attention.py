"""Self-attention with a bucketed relative position bias (T5, MPNet), over packed whole-prompt
batches.

T5 and MPNet add a learned bias to every attention score, looked up by the bucket of the
distance between key and query (exact for near tokens, logarithmic up to ``max_distance``,
constant beyond); T5 does not scale the q.k product, MPNet does. The bias depends only on that
distance, so all requests of one length share one ``[heads, L, L]`` bias, and a group of them
attends in one ``scaled_dot_product_attention`` call with the bias as its additive float mask.
aten's flash kernels take no additive bias; this works on any device and dtype. Where the
deployment runs the Triton kernel (CUDA, half precision), :func:`biased_varlen_attention`
attends the packed step in one launch instead, adding the bias by distance inside the kernel
(no padding, no mask, nothing read on the host: it runs inside CUDA graphs).

Groups: on the CPU, requests of equal length (the CPU's steps come sorted by length, so a
group is a run of neighbours, read as views of the packed rows: nothing is gathered). On CUDA,
where a call per length would leave the GPU waiting on the host (a step holds hundreds of
requests), lengths are rounded up to buckets (16 tokens wide up to 256, then 8 per octave),
each bucket's requests are gathered into one padded batch, and the padded keys are masked
with -inf, which leaves every real row's softmax as it was.

Encoders only: every request is a whole prompt (its keys are its queries, no KV cache).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import triton_attention
from .attention import AttentionMetadata

# Mask rows are laid out 16 elements apart: CUDA's memory-efficient kernel reads them so, and
# copies any other mask into that layout on every call (every layer).
_ALIGN = 16
# Most elements one padded group's mask may hold (bigger groups are split): 64 MiB in bf16.
_MASK_ELEMENTS = 1 << 25
# Not cuDNN's attention, which torch prefers on Hopper: it builds an execution plan for every
# new shape, and the groups' shapes change with every step (it cost 100 ms of host time per
# step of a gtr-t5-base shape on an H200). On CUDA the memory-efficient kernel takes the mask
# (flash takes none); on the CPU the flash kernel does.
_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def relative_position_bucket(
    relative_position: torch.Tensor, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """Bidirectional bucket of each ``key - query`` distance, with transformers' float ops
    (``T5Attention._relative_position_bucket``) so that the boundaries fall where its do."""
    num_buckets //= 2  # half for keys after the query, half for keys before it
    buckets = (relative_position > 0).to(torch.long) * num_buckets
    distance = torch.abs(relative_position)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # Distances from max_exact on share logarithmically wider buckets, up to max_distance.
    if_large = max_exact + (
        torch.log(distance.float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    if_large = torch.min(if_large, torch.full_like(if_large, num_buckets - 1))
    return buckets + torch.where(is_small, distance, if_large)


class RelativePositionBias(nn.Module):
    """A ``relative_attention_bias`` table ``[rows, heads]`` (``rows``: ``num_buckets`` unless
    the checkpoint's table is larger than the buckets used, as MPNet's may be) and the bias it
    gives a request of ``L`` tokens: ``[1, heads, L, L]`` (query rows, key columns), in the
    table's dtype. Every distance of ``max_distance`` or more falls in the last bucket of its
    side, so the buckets of the distances ``-max_distance..max_distance`` are computed once, on
    the host, and longer distances are clamped onto them."""

    buckets: torch.Tensor  # buffer [2 * max_distance + 1]

    def __init__(
        self, num_buckets: int, max_distance: int, num_heads: int, rows: int | None = None
    ) -> None:
        super().__init__()
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.weight = nn.Parameter(torch.empty(rows or num_buckets, num_heads))
        # [2 * max_distance + 1] int64: bucket of distance d at index d + max_distance
        self.register_buffer("buckets", torch.empty(2 * max_distance + 1, dtype=torch.long),
                             persistent=False)  # fmt: skip

    def reset_buffers(self) -> None:
        # On the host in int64/fp32 whatever the device, as the fp32 CPU reference computes them.
        distances = torch.arange(-self.max_distance, self.max_distance + 1)
        host = relative_position_bucket(distances, self.num_buckets, self.max_distance)
        self.buckets = host.to(self.buckets.device)

    def by_distance(self) -> torch.Tensor:
        """[heads, 2 * max_distance + 1] float32: the bias of each ``key - query`` distance
        from ``-max_distance`` to ``max_distance`` (the Triton kernel's table)."""
        return F.embedding(self.buckets, self.weight).t().float().contiguous()

    def forward(self, length: int) -> torch.Tensor:
        pos = torch.arange(length, device=self.weight.device)
        distance = (pos[None, :] - pos[:, None]).clamp_(-self.max_distance, self.max_distance)
        values = F.embedding(self.buckets[distance + self.max_distance], self.weight)  # [L, L, H]
        return _aligned_empty(1, self.weight.shape[1], length, self.weight).copy_(
            values.permute(2, 0, 1).unsqueeze(0)
        )


@dataclass(frozen=True)
class Group:
    """``size`` requests padded to ``length`` rows each, from row ``row`` of the padded layout
    on; ``mask``: [size or 1, heads, length, length], the bias plus -inf on padded keys."""

    row: int
    size: int
    length: int
    mask: torch.Tensor


@dataclass(frozen=True)
class BiasedAttentionPlan:
    """One step's attention groups, built once per forward and shared by every layer of the
    stage (T5 reuses its first layer's bias in all of them). The padded layout is the groups'
    rows back to back; ``gather`` and ``scatter`` map between it and the packed batch, None
    where the two are the same (no padding, groups in packed order)."""

    groups: list[Group]
    gather: torch.Tensor | None  # [P] int64: packed row read into each padded row
    scatter: torch.Tensor | None  # [T] int64: padded row holding each packed row's output

    @classmethod
    def build(
        cls, cu_seqlens: np.ndarray, table: RelativePositionBias, *, exact: bool
    ) -> BiasedAttentionPlan:
        """``cu_seqlens``: [R+1] host offsets of the step's whole-prompt requests; ``exact``:
        group equal lengths only (no padding), else lengths that share a bucket."""
        cu = np.asarray(cu_seqlens, dtype=np.int64)
        lens = np.diff(cu)
        heads = table.weight.shape[1]
        groups, gathers, biases = [], [], {}
        start = np.empty(len(lens), dtype=np.int64)  # each request's first padded row
        row = 0
        for members in _groups(lens if exact else _bucket(lens)):
            length = int(lens[members].max())
            if length not in biases:
                biases[length] = table(length)
            for part in _parts(members, lens, length, heads):
                padded = bool((lens[part] != length).any())
                mask = _padded_mask(biases[length], lens[part]) if padded else biases[length]
                groups.append(Group(row, len(part), length, mask))
                start[part] = row + length * np.arange(len(part))
                # Padded rows repeat their request's last token: finite, and masked as keys.
                within = np.minimum(np.arange(length), lens[part, None] - 1)
                gathers.append((cu[part, None] + within).ravel())
                row += len(part) * length
        scatter = np.repeat(start - cu[:-1], lens) + np.arange(cu[-1])
        if row == cu[-1] and (scatter == np.arange(row)).all():
            return cls(groups, None, None)
        device = table.weight.device
        return cls(
            groups,
            torch.from_numpy(np.concatenate(gathers)).to(device),
            torch.from_numpy(scatter).to(device),
        )


def biased_attention(
    qkv: torch.Tensor, plan: BiasedAttentionPlan, heads: int, head_dim: int, scale: float = 1.0
) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v per request (T5: unscaled). qkv: [T, 3 * heads *
    head_dim] (q | k | v, as one fused projection gives them) -> [T, heads * head_dim]."""
    x = qkv if plan.gather is None else qkv.index_select(0, plan.gather)
    outs = []
    with sdpa_kernel(_BACKENDS):
        for g in plan.groups:
            rows = x[g.row : g.row + g.size * g.length].view(g.size, g.length, 3, heads, head_dim)
            q, k, v = (rows[:, :, i].transpose(1, 2) for i in range(3))  # [n, H, L, D] views
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale)
            outs.append(out.transpose(1, 2).reshape(g.size * g.length, heads * head_dim))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out if plan.scatter is None else out.index_select(0, plan.scatter)


def biased_varlen_attention(
    qkv: torch.Tensor,
    meta: AttentionMetadata,
    by_distance: torch.Tensor,
    heads: int,
    head_dim: int,
    scale: float = 1.0,
) -> torch.Tensor:
    """:func:`biased_attention` of a step of whole prompts as one Triton launch (from the
    step's work list where it has one): ``by_distance`` is the bias table's
    :meth:`RelativePositionBias.by_distance`. qkv: [T, 3 * heads * head_dim] -> [T, heads *
    head_dim]."""
    assert not meta.causal and meta.key_rows is None, "whole bidirectional prompts only"
    q, k, v = qkv.view(-1, 3, heads, head_dim).unbind(1)  # [T, H, D] views
    out = triton_attention.varlen_attention(
        q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_q, causal=False, scale=scale,
        bias=by_distance, work=meta.work, programs=meta.work_programs,
    )  # fmt: skip
    return out.view(-1, heads * head_dim)


def _groups(keys: np.ndarray) -> list[np.ndarray]:
    """Request indices by key: groups in the order their first request comes, requests in
    packed order within each."""
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    group_of = rank[inverse.reshape(-1)]
    order = np.argsort(group_of, kind="stable")
    return np.split(order, np.flatnonzero(np.diff(group_of[order])) + 1)


def _parts(members: np.ndarray, lens: np.ndarray, length: int, heads: int) -> list[np.ndarray]:
    """A group as calls: whole when its lengths are equal (its mask is the shared bias), else
    in parts whose masks hold at most _MASK_ELEMENTS."""
    if (lens[members] == length).all():
        return [members]
    per_call = max(1, _MASK_ELEMENTS // (heads * length * _aligned(length)))
    return np.split(members, range(per_call, len(members), per_call))


def _bucket(lens: np.ndarray) -> np.ndarray:
    """Each length rounded up to its bucket: multiples of 16 up to 256, then of 1/8 of the
    power of two below it (at most 12.5% padding)."""
    octave = 1 << (np.floor(np.log2(np.maximum(lens, 1))).astype(np.int64))
    width = np.maximum(16, octave // 8)
    return -(-lens // width) * width


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _aligned_empty(size: int, heads: int, length: int, like: torch.Tensor) -> torch.Tensor:
    """[size, heads, length, length] whose rows lie _ALIGN elements apart."""
    storage = like.new_empty((size, heads, length, _aligned(length)))
    return storage[..., :length]


def _padded_mask(bias: torch.Tensor, lens: np.ndarray) -> torch.Tensor:
    """bias [1, H, L, L] for requests of ``lens`` (<= L) padded to L: -inf on their padded
    keys. (Padded queries keep finite rows; their outputs are never read.)"""
    n, heads, length = len(lens), bias.shape[1], bias.shape[-1]
    mask = _aligned_empty(n, heads, length, bias)
    mask.copy_(bias.expand(n, -1, -1, -1))
    lens_t = torch.from_numpy(lens).to(bias.device)
    padded = torch.arange(length, device=bias.device)[None, :] >= lens_t[:, None]  # [n, L]
    return mask.masked_fill_(padded[:, None, None, :], float("-inf"))
