"""The Triton variable-length attention kernel against the portable one (per-request SDPA in
fp32): causal chunks after a cached prefix (bottom-right masks), sliding windows, bidirectional
requests, grouped KV heads, soft-capped scores (Gemma2, against softcap_attend), symmetric
windows on whole prompts (ModernBERT), a relative position bias (MPNet), every head size
it is chosen for. On the CPU through Triton's
interpreter (fp32), and on a GPU in bf16."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import check_of, run_interpreted

pytest.importorskip("triton")

_CASES = r"""
import numpy as np
import torch
from pipepool.layers.attention import AttentionMetadata, _portable
from pipepool.layers.softcap_attention import softcap_attend
from pipepool.layers.triton_attention import TILES, varlen_attention, work_list


def check(dtype, device, head_dims, tiles, tol):
    # Every case launched as a grid from the step; for the first head size also from a work
    # list, with one program per item and with more (a CUDA graph's fixed grid: the rest
    # find no item).
    torch.manual_seed(0)
    for d in head_dims:
        for causal, window, hq, hkv, cap in (
            (True, None, 4, 2, None), (True, 5, 4, 2, None), (False, None, 3, 3, None),
            (True, None, 4, 1, None), (True, 5, 4, 2, 1.5), (False, None, 3, 3, 1.5),
        ):
            # causal: request 1 is 7 queries after an 18-key prefix, the others their own keys
            lq = np.array([0, 5, 12, 49, 200])
            lk = lq if not causal else np.array([0, 5, 30, 67, 218])
            q = torch.randn(int(lq[-1]), hq, d, device=device).to(dtype)
            kv = torch.randn(int(lk[-1]), 2 * hkv, d, device=device).to(dtype)
            k, v = kv[:, :hkv], kv[:, hkv:]  # strided views, as the projections leave them
            cu_q = torch.tensor(lq, dtype=torch.int32, device=device)
            cu_k = torch.tensor(lk, dtype=torch.int32, device=device)
            meta = AttentionMetadata(
                causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                max_q=int(np.diff(lq).max()), max_k=int(np.diff(lk).max()),
                cu_q_host=lq, cu_k_host=lk, total_k=int(lk[-1]),
            )
            qf, kf, vf = q.float(), k.float(), v.float()
            if cap is None:
                want = _portable(qf, kf, vf, meta, d**-0.5, window)
            else:  # a cap well inside these scores' range, so that it changes them
                want = softcap_attend(
                    qf, kf, vf, meta, None, scale=d**-0.5, softcap=cap, window=window
                )
            for tile in tiles:
                block_m = (tile or TILES[d])[0]
                work = work_list(lq, block_m)
                grids = (0, int(work[0]), int(work[0]) + 9) if d == head_dims[0] else (0,)
                for programs in grids:
                    given = torch.from_numpy(work).to(device) if programs else None
                    out = torch.full((int(lq[-1]), hq, d), float("nan"), device=device, dtype=dtype)
                    got = varlen_attention(
                        q, k, v, cu_q, cu_k, meta.max_q, causal=causal, scale=d**-0.5,
                        window=window, softcap=cap, out=out, tile=tile, work=given,
                        programs=programs,
                    )
                    assert got is out
                    err = (got.float() - want).abs().max().item()
                    assert err < tol, (dtype, d, causal, window, cap, hq, hkv, tile, programs, err)
    check_bidirectional(dtype, device, head_dims, tiles, tol)
    print("ok")


def check_bidirectional(dtype, device, head_dims, tiles, tol):
    # Whole prompts with a symmetric window (ModernBERT's local layers, against the portable
    # windowed attention) and with a relative position bias by distance (MPNet, T5: against
    # SDPA with the bias as the mask), from the work list as encoders run it; prompts shorter
    # and longer than the window, the bias's distance and the tiles.
    from pipepool.layers.windowed_attention import _portable as windowed

    lens = np.array([0, 3, 40, 170, 173])
    for d in head_dims:
        q, k, v = (torch.randn(int(lens[-1]), 2, d, device=device).to(dtype) for _ in "qkv")
        cu = torch.tensor(lens, dtype=torch.int32, device=device)
        meta = AttentionMetadata(
            causal=False, cu_seqlens_q=cu, cu_seqlens_k=cu, max_q=int(np.diff(lens).max()),
            max_k=int(np.diff(lens).max()), cu_q_host=lens, cu_k_host=lens,
            total_k=int(lens[-1]),
        )
        qf, kf, vf = q.float(), k.float(), v.float()
        max_distance = 20
        bias = torch.randn(2, 2 * max_distance + 1, device=device)
        want_biased = torch.empty_like(qf)
        for a, b in zip(lens[:-1], lens[1:]):
            pos = torch.arange(b - a, device=device)
            rel = (pos[None, :] - pos[:, None]).clamp(-max_distance, max_distance) + max_distance
            mask = bias[:, rel]  # [H, L, L]
            out = torch.nn.functional.scaled_dot_product_attention(
                qf[a:b].transpose(0, 1), kf[a:b].transpose(0, 1), vf[a:b].transpose(0, 1),
                attn_mask=mask, scale=d**-0.5,
            )
            want_biased[a:b] = out.transpose(0, 1)
        for tile in tiles:
            work = work_list(lens, (tile or TILES[d])[0])
            given = torch.from_numpy(work).to(device)
            for half in (2, 7, 33):
                want = windowed(qf, kf, vf, meta, d**-0.5, half)
                got = varlen_attention(
                    q, k, v, cu, cu, meta.max_q, causal=False, scale=d**-0.5, window=half,
                    tile=tile, work=given, programs=int(work[0]),
                )
                err = (got.float() - want).abs().max().item()
                assert err < tol, (dtype, d, "window", half, tile, err)
            got = varlen_attention(
                q, k, v, cu, cu, meta.max_q, causal=False, scale=d**-0.5, bias=bias,
                tile=tile, work=given, programs=int(work[0]),
            )
            err = (got.float() - want_biased).abs().max().item()
            assert err < tol, (dtype, d, "bias", tile, err)
"""


def test_kernel_matches_portable_attention_in_the_interpreter():
    script = _CASES + "\ncheck(torch.float32, 'cpu', (32, 64), ((16, 16, 4, 1),), 1e-4)\n"
    run_interpreted(script, timeout=600)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_matches_portable_attention_on_the_gpu():
    from pipepool.layers.triton_attention import TILES

    # The same cases as the interpreter's, in this process.
    check_of(_CASES)(torch.bfloat16, "cuda", tuple(TILES), (None,), 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_is_chosen_where_it_applies():
    from pipepool.layers.attention import AttentionShape, choose_kernel

    def chosen(*shape) -> str:
        return choose_kernel(torch.device("cuda"), torch.bfloat16, AttentionShape(*shape))

    assert chosen(32, 1, False, False) == "triton"  # an all-MiniLM-L6-v2-sized encoder
    assert chosen(128, 2, True, False) == "triton"  # Qwen3-0.6B
    assert chosen(128, 4, True, True) == "triton"  # a sliding-window decoder
    assert chosen(80, 1, True, False) == "flash"  # not a power of two


def test_rows_that_see_no_key_are_zeros_like_flash():
    """A chunk longer than its keys (bottom-right: its first queries precede every key) gets
    zeros in those rows, as aten's flash kernel gives, not NaN."""
    script = r"""
import torch
from pipepool.layers.triton_attention import varlen_attention
torch.manual_seed(0)
q, k, v = torch.randn(12, 2, 32), torch.randn(5, 2, 32), torch.randn(5, 2, 32)
cu_q, cu_k = torch.tensor([0, 12], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)
out = varlen_attention(q, k, v, cu_q, cu_k, 12, causal=True, scale=0.2, tile=(16, 16, 4, 1))
assert torch.equal(out[:7], torch.zeros(7, 2, 32)), out[:7]
assert torch.isfinite(out).all() and out[7:].abs().sum() > 0
print("ok")
"""
    run_interpreted(script, timeout=600)
