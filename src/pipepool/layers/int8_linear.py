"""Dynamic int8 linear layers on the CPU (``EngineConfig.dtype="int8"``), through FBGEMM.

Each weight is quantized once, at load, to int8 per output channel (symmetric: scale =
max |w| / 127, zero point 0) and packed for FBGEMM. At run time
``torch.ops.quantized.linear_dynamic`` quantizes the activations to uint8 with one scale and
zero point per call, multiplies in int8 with int32 accumulation (VNNI's ``vpdpbusd``), and
returns fp32. Activation functions, residual adds and LayerNorms stay fp32 around it.

Each row (token) is quantized on its own range: it is divided by its largest magnitude before
the call, and one more row holding +1 and -1 joins the tile, so the call's scale and zero
point always span exactly [-1, 1]; the output rows are multiplied back and the bias added in
fp32. With one scale per tile, a token's result depended on the largest activation of every
request sharing its step (the worst text's cosine fell from 0.973 to 0.955 when two replicas
batched passages differently, docs/benchmarks/cpu.md issue 36); now a row's result is the same,
bit for bit, whatever else is in the tile.

Kernel choice, measured on MiniLM shapes (2048 rows; 384 -> 1152, 384, 1536 and 1536 -> 384;
2 busy Sapphire Rapids cores with AVX512-VNNI and no AMX, torch 2.13): FBGEMM's dynamic
linear and oneDNN's ``onednn::qlinear_pointwise`` (with its fused epilogues, activations
quantized by a separate op) were within the machine's noise of each other, 44-48 ms against
~65 ms for the oneDNN fp32 linears of the same four shapes; per-row activation scales through
``torch._int_mm`` plus an fp32 epilogue cost 2-6x more in the epilogue than the GEMM saved,
hence the rows scaled around FBGEMM's op instead.

``reduce_range=False``: with VNNI the uint8 x int8 products accumulate in int32 directly; CPUs
without it pair them in saturating int16 sums, which :func:`supported` detects (a batch built
to saturate them) and then refuses int8 rather than return clipped values.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F

# Largest error :func:`supported` accepts against F.linear, relative to the output's largest
# magnitude: measured 1.1% (random batch) and 0.1% (saturating batch) with VNNI; clipped int16
# sums without it are off by far more.
_CHECK_RTOL = 0.03
# Below this largest magnitude a row is taken as zero (its scale, so as not to divide by 0).
_TINY = 1e-30


@functools.cache
def engine() -> str | None:
    """The quantized engine used to pack weights: FBGEMM (x86's, VNNI), None if absent."""
    engines = torch.backends.quantized.supported_engines
    return "fbgemm" if "fbgemm" in engines else None


@contextlib.contextmanager
def _quantized_engine(name: str) -> Iterator[None]:
    """torch's quantized engine is process-global: set it for one packing and put it back."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


class Int8Weight(NamedTuple):
    """A linear layer's weight packed for FBGEMM as per-channel symmetric int8 (no bias), and
    its bias in fp32 (None: none)."""

    packed: torch.ScriptObject
    bias: torch.Tensor | None


def pack(weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Weight:
    """``weight`` [out, in] as per-channel symmetric int8, packed for :func:`linear`, and
    ``bias`` kept fp32. An extra copy, a quarter of the fp32 weight's size."""
    name = engine()
    assert name is not None, "check supported() first"
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp_(min=1e-12)  # [out]
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
    zero = torch.zeros(w.shape[0], dtype=torch.long)
    b = bias.detach().float().contiguous() if bias is not None else None
    with warnings.catch_warnings(), _quantized_engine(name):
        # The quantized-tensor constructors warn that they are deprecated; the packed weight
        # is their only use, and supported() fails (the engine refuses int8) once they go.
        warnings.simplefilter("ignore", UserWarning)
        qweight = torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)
        return Int8Weight(torch.ops.quantized.linear_prepack(qweight, None), b)


def linear(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """x @ W.T + bias for fp32 ``x`` [T, in] -> fp32 [T, out], int8 inside, each row quantized
    on its own scale (module docstring)."""
    rows = x.shape[0]
    scale = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True)  # max |x|, [T, 1]
    scale.clamp_(min=_TINY)
    tile = x.new_empty(rows + 1, x.shape[1])
    torch.div(x, scale, out=tile[:rows])
    tile[rows] = 0.0
    tile[rows, 0], tile[rows, 1] = 1.0, -1.0  # (module docstring)
    y = torch.ops.quantized.linear_dynamic(tile, weight.packed, False)[:rows]
    if weight.bias is None:
        return y.mul_(scale)
    return torch.addcmul(weight.bias, y, scale)


@functools.cache
def supported() -> bool:
    """Whether the int8 op exists here and agrees with fp32 ``F.linear`` within int8
    quantization error: on a random batch, and on one whose uint8 x int8 products saturate
    CPUs without VNNI's int32 accumulation."""
    if engine() is None:
        return False
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 64, generator=gen), torch.randn(48, 64, generator=gen)
    b = torch.randn(48, generator=gen)
    # Saturating: every activation at the top of its range times weights at +127.
    x_sat, w_sat = torch.rand(37, 64, generator=gen) + 3.0, torch.rand(48, 64, generator=gen) + 1.0
    try:
        with torch.inference_mode():
            pairs = ((x, w), (x_sat, w_sat))
            checks = [(linear(a, pack(m, b)), F.linear(a, m, b)) for a, m in pairs]
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return all(_close(got, want) for got, want in checks)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.shape != want.shape or not torch.isfinite(got).all():
        return False
    return bool((got - want).abs().max() <= _CHECK_RTOL * want.abs().max())
