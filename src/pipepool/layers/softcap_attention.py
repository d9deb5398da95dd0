"""Attention that the varlen kernels of :mod:`.attention` cannot compute: scores soft-capped
before the softmax (Gemma2's ``tanh(s / cap) * cap``), and symmetric sliding windows of
bidirectional layers (Gemma3 with ``use_bidirectional_attention``: a key is visible when it
lies less than ``window`` positions away on either side).

One implementation for every device, over the same packed (unpadded) batches and paged KV
cache as :func:`.attention.attend`: this step's K/V rows are written to the cache and each
continuing request's cached prefix is gathered in front of its chunk exactly as there, then the
step is cut into runs of consecutive requests with equal query and key lengths
(:func:`.grouped_attention.plan_runs`), each attended in one batched call on views of the
packed rows. Without soft-capping a run goes through ``scaled_dot_product_attention`` with a
boolean mask; with it, the scores are computed explicitly in the arithmetic of transformers'
eager attention (matmul and scale in the model's dtype, cap, mask, softmax in float32), in
tiles of query rows that bound the score matrix's memory.

These calls read the step's host-side offsets, so a CUDA graph cannot hold them: a capture that
reaches one is refused (``GraphedForward`` then runs the stage eagerly).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import AttentionMetadata, with_cached_keys
from .grouped_attention import plan_runs

# Score elements computed at once (per tile of query rows): 64 MiB of float32 scores.
_MAX_SCORES = 1 << 24


def softcap_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
    *,
    scale: float,
    softcap: float | None,
    window: int | None,
) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D]. ``softcap``: scores become
    ``tanh(s / softcap) * softcap`` before masking, None for none. ``window``: causal steps
    (``meta.causal``) let a query see the ``window`` keys up to itself, as ``attend`` does;
    bidirectional steps let it see keys at a distance below ``window`` on either side; None for
    unlimited."""
    if meta.graph_split is not None or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        raise RuntimeError(
            "soft-capped / symmetric-window attention reads the step's host-side offsets and "
            "cannot be captured in a CUDA graph"
        )
    k, v = with_cached_keys(k, v, meta, kv_cache)
    if meta.group_plan is None:  # the runs depend on the step only: shared by every layer
        meta.group_plan = plan_runs(meta.cu_q_host, meta.cu_k_host, meta.causal)
    out = torch.empty_like(q)
    for run in meta.group_plan.runs:
        n, lq, lk = run.size, run.len_q, run.len_k
        # [n, H, len, D] views of the run's rows (consecutive requests, equal lengths).
        qr = q[run.q_row : run.q_row + n * lq].unflatten(0, (n, lq)).transpose(1, 2)
        kr = k[run.k_row : run.k_row + n * lk].unflatten(0, (n, lk)).transpose(1, 2)
        vr = v[run.k_row : run.k_row + n * lk].unflatten(0, (n, lk)).transpose(1, 2)
        mask = visible(lq, lk, meta.causal, window, q.device)
        if softcap is None:
            o = _sdpa(qr, kr, vr, mask, scale)
        else:
            o = _capped(qr, kr, vr, mask, scale, softcap)
        out[run.q_row : run.q_row + n * lq] = o.transpose(1, 2).flatten(0, 1)
    return out


def visible(
    len_q: int, len_k: int, causal: bool, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """[len_q, len_k] boolean, True where a query may see a key; the queries are the last len_q
    of the len_k keys (a chunk after its cached prefix). None when every key is visible."""
    q_pos = torch.arange(len_k - len_q, len_k, device=device)[:, None]
    k_pos = torch.arange(len_k, device=device)[None, :]
    if causal:
        mask = k_pos <= q_pos
        return mask & (k_pos > q_pos - window) if window is not None else mask
    return None if window is None else (q_pos - k_pos).abs() < window


def _sdpa(q, k, v, mask, scale: float) -> torch.Tensor:
    if q.device.type != "cpu" and q.shape[1] != k.shape[1]:
        # With a mask, only the GPU's memory-efficient kernel keeps memory linear in the keys,
        # and it takes equal head counts.
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def _capped(q, k, v, mask, scale: float, softcap: float) -> torch.Tensor:
    """q: [n, Hq, lq, D], k/v: [n, Hkv, lk, D] -> [n, Hq, lq, D], each query head reading KV
    head ``h // (Hq / Hkv)`` as transformers' ``repeat_kv`` does."""
    n, hq, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    qg = q.unflatten(1, (hkv, hq // hkv))  # [n, Hkv, G, lq, D]
    kt = k.unsqueeze(2).transpose(-1, -2)  # [n, Hkv, 1, D, lk]
    vg = v.unsqueeze(2)  # [n, Hkv, 1, lk, D]
    out = q.new_empty(qg.shape)
    rows = max(1, _MAX_SCORES // (n * hq * lk))
    for r0 in range(0, lq, rows):
        r1 = min(lq, r0 + rows)
        scores = torch.matmul(qg[..., r0:r1, :], kt) * scale  # [n, Hkv, G, r, lk]
        scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            scores = scores.masked_fill(~mask[r0:r1], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[..., r0:r1, :] = torch.matmul(probs, vg)
    return out.flatten(1, 2)
