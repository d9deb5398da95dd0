"""Attention over a packed (unpadded) batch of requests, with the paged KV cache.

The one interface every model uses is :func:`attend`. It

1. writes this step's K/V rows that later chunks will read into the cache,
2. assembles, per request, the keys ``[0, end)`` of its chunk (the cached prefix, then this
   chunk), contiguous in one packed K/V; or (bidirectional steps with key lengths, ColBERT's
   query expansion) the first ``key_len`` rows of each request, gathered by ``key_rows``,
3. runs a variable-length attention kernel with causal masks aligned bottom-right (a chunk
   of ``q`` tokens at the end of ``k`` keys), or bidirectional for encoders.

Kernels (``choose_kernel`` picks one per stage, at load):

- ``triton``: :mod:`.triton_attention` (CUDA, fp16/bf16, power-of-two head sizes 32-256):
  1.5-2.9x the flash op below on the steps of short requests we run
  (docs/benchmarks/gpu-short-inputs.md);
- ``flash``: aten's variable-length flash-attention op, called directly (CUDA, fp16/bf16);
- ``varlen``: the same op through ``torch.nn.attention.varlen.varlen_attn``, whose custom-op
  wrapper costs tens of microseconds of Python per call and imports ``torch._dynamo`` (seconds
  at start-up): only where the direct call fails its check;
- ``portable``: ``scaled_dot_product_attention``, any dtype: on the CPU over padded groups of
  equal-length requests (:mod:`.grouped_attention`), on other devices once per request.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import numpy as np
import torch
import torch.nn.functional as F

from . import invariant_ops, triton_attention
from .grouped_attention import GroupPlan, grouped_attention, plan_runs
from .invariant_attention import invariant_attention


class GraphSplit(Protocol):
    """What ``attend`` hands its inputs to while a CUDA graph is captured
    (stage/cuda_graphs.py): it returns the attention's output."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
        *,
        scale: float,
        window: int | None,
        kernel: str,
        softcap: float | None,
    ) -> torch.Tensor: ...


@dataclass
class AttentionMetadata:
    """Everything a layer needs to attend for one step; built once per step by the runner.

    Tensors live on the model's device; ``*_host`` arrays are the same numbers on the host
    for the portable kernel's per-request loop (no device->host sync needed to read them).
    """

    causal: bool
    cu_seqlens_q: torch.Tensor  # [R+1] int32: row offsets of each request's chunk in the batch
    cu_seqlens_k: torch.Tensor  # [R+1] int32: offsets of each request's keys [0, end) in packed K/V
    max_q: int
    max_k: int
    cu_q_host: np.ndarray  # == cu_seqlens_q
    cu_k_host: np.ndarray  # == cu_seqlens_k
    # Cache writes: rows of this step's K/V that a later chunk of the same request will read.
    write_rows: torch.Tensor | None = None  # [Nw] int64 row indices into this step's K/V
    write_slots: torch.Tensor | None = None  # [Nw] int64 flat cache slots
    # Cache reads, present only when some request continues an earlier chunk.
    chunk_dst: torch.Tensor | None = None  # [T] row in packed K/V of each of this step's tokens
    prefix_dst: torch.Tensor | None = None  # [Np] rows of packed K/V filled from the cache
    prefix_slots: torch.Tensor | None = None  # [Np] cache slots they are read from
    total_k: int = 0  # rows of packed K/V (== T when no request has a cached prefix)
    # The Triton kernel's work list (triton_attention.work_list, uploaded with the step: an
    # encoder's steps) and the programs it launches for it; None: a grid from the step.
    work: torch.Tensor | None = None
    work_programs: int = 0
    # While a CUDA graph is captured (stage/cuda_graphs.py): attention is where the graph is
    # cut, so ``attend`` hands its inputs to this instead of computing.
    graph_split: GraphSplit | None = None
    # CPU: the step's runs of equal-length requests, planned by the first layer that attends.
    group_plan: GroupPlan | None = field(default=None, repr=False)
    # Bidirectional steps where some request's keys are only its first key_len tokens (the
    # rest attend but are not attended to: ColBERT's query expansion): the rows of this step's
    # K/V that are keys, request after request ([total_k] int64, ``prefix_key_rows``); then
    # ``cu_seqlens_k`` / ``cu_k_host`` / ``max_k`` / ``total_k`` count those keys. None: every
    # row is a key (and steps are exactly as they were without the feature).
    key_rows: torch.Tensor | None = None

    @property
    def key_lens(self) -> np.ndarray | None:
        """Keys of each request where ``key_rows`` picks them (a prefix of its rows); None
        where every row of every request is a key."""
        return np.diff(self.cu_k_host) if self.key_rows is not None else None


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
    *,
    scale: float,
    window: int | None = None,
    kernel: str = "portable",
    out: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D]. ``window``: keys a query may see, itself
    included (sliding-window attention), None for unlimited. ``out``: where to put the result
    (the triton kernel writes there directly, the others copy), or None for a new tensor.
    ``softcap``: scores soft-capped (Gemma2), which only the triton kernel computes (the others
    are :func:`.softcap_attention.softcap_attend`'s)."""
    if softcap is not None and kernel != "triton":
        raise ValueError("soft-capped attention here needs the triton kernel")
    if meta.graph_split is not None:
        return meta.graph_split(
            q, k, v, kv_cache, scale=scale, window=window, kernel=kernel, softcap=softcap
        )
    k, v = with_cached_keys(k, v, meta, kv_cache)
    if kernel != "triton" and invariant_ops.active():  # the triton kernel is invariant as it is
        result = invariant_attention(
            q, k, v, meta.cu_q_host, meta.cu_k_host, causal=meta.causal, scale=scale,
            window=window,
        )  # fmt: skip
        return result if out is None else out.copy_(result)
    if kernel == "triton":
        return triton_attention.varlen_attention(
            q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_q, causal=meta.causal,
            scale=scale, window=window, softcap=softcap, out=out, work=meta.work,
            programs=meta.work_programs,
        )  # fmt: skip
    if kernel == "flash":
        result = _flash(q, k, v, meta, scale, window)
    elif kernel == "varlen":
        result = _varlen(q, k, v, meta, scale, window)
    elif q.device.type == "cpu":
        if meta.group_plan is None:
            meta.group_plan = plan_runs(meta.cu_q_host, meta.cu_k_host, meta.causal)
        result = grouped_attention(q, k, v, meta.group_plan, scale, window)
    else:
        result = _portable(q, k, v, meta, scale, window)
    return result if out is None else out.copy_(result)


def with_cached_keys(
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write this step's K/V rows that later chunks read into the cache, then return each
    request's keys and values ``[0, end)`` packed: the cached prefix, then this chunk (every
    attention over chunked prompts starts here). With ``key_rows`` (whole bidirectional
    prompts, no cache): each request's key rows only."""
    if meta.key_rows is not None:
        assert kv_cache is None and meta.prefix_slots is None, "key lengths: whole prompts only"
        return k.index_select(0, meta.key_rows), v.index_select(0, meta.key_rows)
    if kv_cache is not None and meta.write_slots is not None:
        assert meta.write_rows is not None, "cache writes come with the rows they write"
        k_cache, v_cache = kv_cache
        k_cache.index_copy_(0, meta.write_slots, k.index_select(0, meta.write_rows))
        v_cache.index_copy_(0, meta.write_slots, v.index_select(0, meta.write_rows))
    if meta.prefix_slots is not None:
        assert kv_cache is not None, "a chunk continues a request but this layer has no KV cache"
        k = _with_prefix(k, kv_cache[0], meta)
        v = _with_prefix(v, kv_cache[1], meta)
    return k, v


def _with_prefix(x: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    packed = x.new_empty((meta.total_k, *x.shape[1:]))
    packed[meta.chunk_dst] = x
    packed[meta.prefix_dst] = cache[meta.prefix_slots]
    return packed


def prefix_key_rows(cu_q: np.ndarray, key_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cu_k [R+1], rows [cu_k[-1]]) for requests at row offsets ``cu_q`` whose keys are their
    first ``key_lens`` rows (each at most its length): the key offsets, and the rows of the
    step's K/V they are, request after request."""
    cu_k = np.zeros(len(key_lens) + 1, dtype=np.int64)
    np.cumsum(key_lens, out=cu_k[1:])
    rows = np.arange(cu_k[-1], dtype=np.int64) + np.repeat(cu_q[:-1] - cu_k[:-1], key_lens)
    return cu_k, rows


def flash_supported(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cuda"
        and hasattr(torch.ops.aten, "_flash_attention_forward")
        and dtype in (torch.float16, torch.bfloat16)
    )


@dataclass(frozen=True)
class AttentionShape:
    """What a model asks of its attention kernel: the kernel is chosen (and checked) for it."""

    head_dim: int
    group: int  # query heads per KV head
    causal: bool
    windowed: bool  # some layer attends over a sliding window


def choose_kernel(device: torch.device, dtype: torch.dtype, shape: AttentionShape) -> str:
    """The fastest kernel that agrees with the portable one on a small mixed batch of the
    model's kind (causal: with a cached prefix and a chunk longer than its keys, and a sliding
    window where the model has one; else bidirectional) on this device and torch. Only the
    variants the model runs are checked, so a Triton kernel compiles at load exactly the
    specialisations the steps then use."""
    candidates = [k for k in ("flash", "varlen") if flash_supported(device, dtype)]
    if triton_attention.supported(device, dtype, shape.head_dim):
        candidates.insert(0, "triton")
    for kernel in candidates:
        try:
            if _agrees_with_portable(kernel, device, dtype, shape):
                return kernel
        except Exception as exc:  # a signature this torch does not have, a missing kernel
            warnings.warn(f"attention kernel {kernel!r} unusable: {exc}", stacklevel=2)
    if candidates:
        warnings.warn("no fast attention kernel agrees with the reference; using portable",
                      stacklevel=2)  # fmt: skip
    return "portable"


def _agrees_with_portable(
    kernel: str, device: torch.device, dtype: torch.dtype, shape: AttentionShape
) -> bool:
    gen = torch.Generator(device=device).manual_seed(0)
    # Request 1: 7 queries after an 18-key prefix; request 2: 37 queries over 19 keys.
    lq, lk = np.array([0, 5, 12, 49]), np.array([0, 5, 30, 49])
    d, kv_heads = shape.head_dim, 2
    heads = kv_heads * shape.group
    q = torch.randn(int(lq[-1]), heads, d, device=device, dtype=dtype, generator=gen)
    k = torch.randn(int(lk[-1]), kv_heads, d, device=device, dtype=dtype, generator=gen)
    v = torch.randn(int(lk[-1]), kv_heads, d, device=device, dtype=dtype, generator=gen)
    # (causal, window, key offsets); bidirectional: whole prompts (keys = queries), and queries
    # over a prefix of their rows (key lengths, ColBERT's query expansion): keys 3, 10, 14 of 5,
    # 25, 19 queries.
    fewer_keys = np.array([0, 3, 13, 27])
    variants: list[tuple[bool, int | None, np.ndarray]] = [
        (False, None, lk),
        (False, None, fewer_keys),
    ]
    if shape.causal:
        variants = [(True, None, lk), (True, 4, lk)] if shape.windowed else [(True, None, lk)]
    for causal, window, n_k in variants:
        n_q = lq if causal else lk
        meta = AttentionMetadata(
            causal=causal,
            cu_seqlens_q=torch.tensor(n_q, dtype=torch.int32, device=device),
            cu_seqlens_k=torch.tensor(n_k, dtype=torch.int32, device=device),
            max_q=int(np.diff(n_q).max()), max_k=int(np.diff(n_k).max()),
            cu_q_host=n_q, cu_k_host=n_k, total_k=int(n_k[-1]),
        )  # fmt: skip
        qq = q if causal else torch.cat([q, q[: int(lk[-1] - lq[-1])]])
        want = _portable(qq.float(), k.float(), v.float(), meta, 0.125, window)
        got = attend(qq, k, v, meta, None, scale=0.125, window=window, kernel=kernel).float()
        if not torch.allclose(got, want, rtol=2e-2, atol=2e-2):
            return False
    return True


def _flash(q, k, v, meta: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
    # Fewer KV heads than query heads (GQA) go in as they are: the flash kernel shares each KV
    # head with its query group itself.
    # (left, right) keys visible around each query; -1 = unlimited. Causal: right = 0, with
    # the mask aligned bottom-right (a chunk is the last queries of its keys).
    left, right = (-1 if window is None else window - 1, 0) if meta.causal else (-1, -1)
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_q, meta.max_k, 0.0,
        meta.causal and window is None, False,
        scale=scale, window_size_left=left, window_size_right=right,
    )  # fmt: skip
    return out[0]


def _varlen(q, k, v, meta: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    gqa = "enable_gqa" in inspect.signature(varlen_attn).parameters and q.shape[1] != k.shape[1]
    window_size = (-1 if window is None else window - 1, 0) if meta.causal else (-1, -1)
    # Only a torch whose varlen_attn has ``enable_gqa`` gets it (older ones reject it).
    extra: dict[str, Any] = {"enable_gqa": True} if gqa else {}
    out = varlen_attn(
        q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_q, meta.max_k,
        scale=scale, window_size=window_size, **extra,
    )  # fmt: skip
    return cast(torch.Tensor, out)  # without ``return_aux`` it returns the output alone


def _portable(q, k, v, meta: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
    out = torch.empty_like(q)
    cu_q, cu_k = meta.cu_q_host, meta.cu_k_host
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        qi = q[q0:q1].transpose(0, 1)  # [Hq, lq, D]
        ki = k[k0:k1].transpose(0, 1)  # [Hkv, lk, D]
        vi = v[k0:k1].transpose(0, 1)
        mask = _mask(q1 - q0, k1 - k0, meta.causal, window, q.device)
        oi = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=qi.shape[0] != ki.shape[0]
        )
        out[q0:q1] = oi.transpose(0, 1)
    return out


def _mask(lq: int, lk: int, causal: bool, window: int | None, device) -> torch.Tensor | None:
    """Boolean [lq, lk] mask (True = may attend); the chunk's queries are the last lq of lk."""
    if not causal:
        return None
    q_pos = torch.arange(lk - lq, lk, device=device).unsqueeze(1)
    k_pos = torch.arange(lk, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask
