"""The gated-activation Triton kernel (``layers/gated_activation.py``), run on the CPU by Triton's
interpreter: its GELU is torch's to one rounding step in bf16 and fp16 (and to a few ulps in
fp32), and where the two differ in the negative tail it is the closer one to the function's
value; its SiLU is torch's to one rounding step."""

from __future__ import annotations

import pytest
from triton_interpreter import run_interpreted

pytest.importorskip("triton")

_SCRIPT = r"""
import torch
from pipepool.layers.gated_activation import agrees, gelu_tanh_and_mul, reference, silu_and_mul

torch.manual_seed(0)
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    # 1100 columns: a block and a partial one; a strided view as the projection may give.
    x = (torch.randn(23, 2 * 1100) * 2).to(dtype)
    x[0, :4] = torch.tensor([-30.0, 30.0, 0.0, -6.3]).to(dtype)
    got, want = gelu_tanh_and_mul(x), reference(x)
    assert got.shape == (23, 1100) and got.dtype == dtype
    assert agrees(want, got), dtype
    if dtype != torch.float32:  # rounded to 16 bits, the two GELUs' last fp32 bits rarely show
        assert (got != want).float().mean().item() < 0.05, dtype
    # Against the function's value in float64 (as x * sigmoid(2u): 1 + tanh(u) cancels even in
    # float64 below x = -8): never further than torch's result but for a rounding step of the
    # dtype (subnormals' fixed step in fp16; in fp32, where nothing rounds the last bits away,
    # ulps by the exponential's argument, which reaches ~30 in the tail).
    gate, up = x.double().chunk(2, -1)
    true = gate * torch.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate**3)) * up
    info = torch.finfo(dtype)
    step = (32 if dtype == torch.float32 else 1) * info.eps * true.abs() + info.eps * info.tiny
    assert ((got.double() - true).abs() <= (want.double() - true).abs() + step).all(), dtype
    strided = torch.cat([x, x], 1)[:, ::2]
    assert torch.equal(gelu_tanh_and_mul(strided), gelu_tanh_and_mul(strided.contiguous()))
    got, want = silu_and_mul(x), reference(x, silu=True)
    assert got.shape == (23, 1100) and agrees(want, got), dtype
    if dtype != torch.float32:
        assert (got != want).float().mean().item() < 0.05, dtype
    assert torch.equal(silu_and_mul(strided), silu_and_mul(strided.contiguous()))
assert gelu_tanh_and_mul(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 32)
assert silu_and_mul(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 32)
print("ok")
"""


def test_gated_kernels_match_torch_in_the_interpreter():
    run_interpreted(_SCRIPT, timeout=600)


_BIAS_GELU_SCRIPT = r"""
import torch
import torch.nn.functional as F
from pipepool.layers.gated_activation import add_bias_, agrees, bias_gelu_tanh_

torch.manual_seed(0)
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    # 1100 columns: a block and a partial one; rows of a larger buffer, as a tiled product's.
    y = (torch.randn(30, 1100) * 2).to(dtype)[:23]
    bias = torch.randn(1100).to(dtype)
    want = F.gelu(y + bias, approximate="tanh")  # the eager ops it replaces
    got = bias_gelu_tanh_(y.clone(), bias)
    assert got.shape == want.shape and got.dtype == dtype
    assert agrees(want, got), dtype
    if dtype != torch.float32:
        assert (got != want).float().mean().item() < 0.05, dtype
    # Elementwise: a row's result is the same alone and among others.
    assert torch.equal(bias_gelu_tanh_(y[5:6].clone(), bias), got[5:6])
    inplace = y.clone()
    assert bias_gelu_tanh_(inplace, bias) is inplace and torch.equal(inplace, got)
    summed = y.clone()
    assert add_bias_(summed, bias) is summed and torch.equal(summed, y + bias), dtype
assert bias_gelu_tanh_(torch.empty(0, 8, dtype=torch.bfloat16), torch.zeros(8)).shape == (0, 8)
print("ok")
"""


def test_bias_gelu_kernel_matches_torch_in_the_interpreter():
    run_interpreted(_BIAS_GELU_SCRIPT, timeout=600)
