"""CPU attention over groups of equal-length requests against a plain per-request reference.

The steps are built the way the runner builds them (``build_host_batch`` -> ``to_step_inputs``),
so chunks that continue a request read their prefix keys from the paged KV cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipepool.layers import grouped_attention as ga
from pipepool.layers.attention import attend
from pipepool.stage.batch import DeviceUploader, build_host_batch, to_step_inputs

BLOCK = 4
HEAD_DIM = 8


def _reference(q, k, v, scale, causal, window):
    """One request in float64: q [lq, Hq, D] are the last lq positions of keys k/v [lk, Hkv, D]."""
    lq, lk, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(lk - lq, lk)[:, None]
    k_pos = torch.arange(lk)[None, :]
    allowed = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        allowed &= k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _run_step(starts, lens, heads_q, heads_kv, *, causal, window, seed=0):
    """Attend one step of chunks [start, start + len) and return (engine, reference) outputs."""
    gen = torch.Generator().manual_seed(seed)
    starts, lens = np.asarray(starts), np.asarray(lens)
    ends = starts + lens
    # Whole prompts' q/k/v; the cache holds each request's prefix, the step gets its chunk.
    full = [
        [torch.randn(int(e), h, HEAD_DIM, generator=gen) for h in (heads_q, heads_kv, heads_kv)]
        for e in ends
    ]
    prompt_lens = ends + 1 if causal else ends  # causal chunks write their K/V for a later one
    tables = None
    if causal:
        blocks = -(-(prompt_lens) // BLOCK)
        first = np.concatenate(([0], np.cumsum(blocks)[:-1]))
        tables = [np.arange(f, f + n, dtype=np.int64) for f, n in zip(first, blocks, strict=True)]
    # Every request holds KV blocks here (its chunk writes K/V a later chunk reads).
    kv_rows = np.arange(len(lens)) if causal else None
    batch = build_host_batch(starts, lens, prompt_lens, kv_rows, tables or [], BLOCK)
    inputs, _ = to_step_inputs(batch, DeviceUploader(torch.device("cpu")), causal=causal, extra=[])
    cache = None
    if causal:
        slots = int(sum(len(t) for t in tables)) * BLOCK
        cache = tuple(torch.zeros(slots, heads_kv, HEAD_DIM) for _ in range(2))
        for t, (s, (_, k, v)) in zip(tables, zip(starts, full, strict=True), strict=True):
            pos = np.arange(s)
            rows = torch.from_numpy(t[pos // BLOCK] * BLOCK + pos % BLOCK)
            cache[0][rows], cache[1][rows] = k[:s], v[:s]
    q, k, v = (torch.cat([f[i][s:] for f, s in zip(full, starts, strict=True)]) for i in range(3))
    scale = HEAD_DIM**-0.5
    out = attend(q, k, v, inputs.attn, cache, scale=scale, window=window)
    pairs = zip(full, starts, strict=True)
    ref = torch.cat(
        [_reference(fq[s:], fk, fv, scale, causal, window) for (fq, fk, fv), s in pairs]
    )
    return out, ref


def _assert_close(out, ref):
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


# Lengths from 1 to 300, multiples of 16 and not; equal neighbours attend as one run.
MIXED_LENS = [1, 3, 16, 17, 40, 41, 41, 41, 64, 64, 100, 257, 5, 300, 2, 2]


def test_encoder_padded_groups_match_per_request_reference():
    out, ref = _run_step(
        np.zeros(len(MIXED_LENS), int), MIXED_LENS, 4, 4, causal=False, window=None
    )
    _assert_close(out, ref)


@pytest.mark.parametrize("window", [None, 1, 7, 50])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_causal_chunks_with_prefix_match_per_request_reference(window, heads):
    # New prompts (start 0) and continued chunks (cached prefix) of all sizes in one step;
    # equal neighbours attend as one run.
    starts = [0, 0, 5, 0, 64, 200, 1, 0, 17, 3, 0, 0, 0, 8, 8, 8]
    lens = [1, 40, 1, 300, 64, 17, 16, 2, 90, 41, 33, 33, 33, 24, 24, 24]
    out, ref = _run_step(starts, lens, *heads, causal=True, window=window)
    _assert_close(out, ref)


def test_single_uniform_causal_group_matches_reference():
    out, ref = _run_step([0, 0, 0], [33, 33, 33], 4, 2, causal=True, window=None)
    _assert_close(out, ref)


def test_runs_cover_every_request_in_packed_order():
    lens = np.array([3, 3, 3, 5, 3, 3, 7, 7])
    cu = np.concatenate(([0], np.cumsum(lens)))
    plan = ga.plan_runs(cu, cu, causal=False)
    assert [(r.q_row, r.size, r.len_q) for r in plan.runs] == [
        (0, 3, 3),
        (9, 1, 5),
        (14, 2, 3),
        (20, 2, 7),
    ]


def test_sorted_encoder_step_pads_keys_into_following_rows():
    # Runs of equal lengths whose keys are padded to 16 read the next request's rows (masked);
    # the very last request cannot and attends unpadded.
    lens = [20] * 5 + [9] * 4 + [1] * 3
    out, ref = _run_step(np.zeros(len(lens), int), lens, 4, 4, causal=False, window=None)
    _assert_close(out, ref)
