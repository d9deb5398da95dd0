"""Linear + activation as one GEMM: cuBLASLt's bias + GELU epilogue on CUDA in 16-bit, the
exact erf form everywhere else."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipepool.layers.linear_activation import linear_activation, uses_gelu_epilogue


def _weights(device: str, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 64, generator=gen)
    w = torch.randn(192, 64, generator=gen) / 4
    b = torch.randn(192, generator=gen)
    return (t.to(device=device, dtype=dtype) for t in (x, w, b))


@pytest.mark.parametrize("activation", ["gelu", "gelu_new", "relu", "identity"])
def test_cpu_computes_the_exact_activation(activation):
    x, w, b = _weights("cpu", torch.float32)
    assert not uses_gelu_epilogue(activation, x, b)
    exact = {
        "gelu": F.gelu(F.linear(x, w, b)),
        "gelu_new": F.gelu(F.linear(x, w, b), approximate="tanh"),
        "relu": F.relu(F.linear(x, w, b)),
        "identity": F.linear(x, w, b),
    }[activation]
    assert torch.equal(linear_activation(x, w, b, activation), exact)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_epilogue_is_gelu_within_the_dtypes_rounding(dtype):
    """The fused GEMM on CUDA in 16-bit; fp32 keeps the exact form. Against float64: the tanh
    form within the output's rounding, and the erf form within that plus 4.7e-4."""
    x, w, b = _weights("cuda", dtype)
    assert uses_gelu_epilogue("gelu", x, b)
    assert not uses_gelu_epilogue("gelu", x.float(), b.float())
    got = linear_activation(x, w, b, "gelu").double()
    pre = F.linear(x.double(), w.double(), b.double())
    step = torch.finfo(dtype).eps  # one unit of the last place, relative
    tanh, erf = F.gelu(pre, approximate="tanh"), F.gelu(pre)
    bound = step * tanh.abs() + 1e-3  # GEMM accumulation order on top of rounding
    assert bool(((got - tanh).abs() <= bound).all())
    assert bool(((got - erf).abs() <= bound + 4.8e-4).all())
