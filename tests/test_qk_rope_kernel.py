"""The fused q/k-norm + RoPE Triton kernel, run on the CPU by Triton's interpreter: it must
round exactly as the torch ops it replaces (bf16) with Qwen3's norm, Gemma's ``1 + weight`` one
or none, and be exact in fp32 without the norm."""

from __future__ import annotations

import pytest
from triton_interpreter import run_interpreted

pytest.importorskip("triton")

_SCRIPT = r"""
import torch
from pipepool.layers.norm import rms_norm
from pipepool.layers.qk_rope import fused_qk_norm_rope
from pipepool.layers.rotary import RotaryEmbedding, apply_rotary
from pipepool.models.gemma import gemma_rms_norm

torch.manual_seed(0)
for dtype in (torch.bfloat16, torch.float32):
    for norm in ("qwen3", "gemma", None):
        T, HQ, HK, D = 29, 16, 8, 128
        rot = RotaryEmbedding(D, D, 1e6, None, 4096)
        qkv = (torch.randn(T, (HQ + 2 * HK) * D) * 3).to(dtype)
        pos = torch.randint(0, 4000, (T,))
        qw, kw = (torch.rand(D) + 0.5).to(dtype), (torch.rand(D) + 0.5).to(dtype)
        q, k, _ = qkv.split([HQ * D, HK * D, HK * D], -1)
        q, k = q.reshape(T, HQ, D), k.reshape(T, HK, D)
        if norm is not None:
            scaled = rms_norm if norm == "qwen3" else gemma_rms_norm
            q, k = scaled(q, qw, 1e-6), scaled(k, kw, 1e-6)
        want = apply_rotary(pos, q, k, rot.cos_sin, D)
        got = fused_qk_norm_rope(
            qkv, pos, rot.cos_sin, qw if norm else None, kw if norm else None,
            num_heads=HQ, num_kv_heads=HK, head_dim=D, eps=1e-6, unit_offset=norm == "gemma",
        )
        for g, w in zip(got, want):
            unequal = (g != w).float().mean().item()
            if dtype == torch.bfloat16:
                # Bit-equal but for the norm's fp32 sum order (one element in 10^4 or so).
                assert unequal < 1e-3, (dtype, norm, unequal)
            elif not norm:
                assert unequal == 0.0, (dtype, norm, unequal)
            torch.testing.assert_close(g.float(), w.float(), rtol=1e-2, atol=1e-5)
print("ok")
"""


def test_fused_kernel_rounds_like_the_torch_ops_in_the_interpreter():
    run_interpreted(_SCRIPT, timeout=600)
