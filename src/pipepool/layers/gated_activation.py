"""Gated activations from the fused gate|up projection as one Triton kernel on CUDA: GeGLU with
the tanh-approximated GELU (Gemma's MLP, ``gelu_tanh(gate) * up``) and SwiGLU
(``silu(gate) * up``, the decoders' MLP, where a batch-invariant forward runs without
``torch.compile``: eager, the two ops took 271 us a layer against this kernel's 94 on an H100,
Qwen3-0.6B shape).

Why GeGLU: inductor's kernel for it, compiled dynamic in the number of tokens, was 7.7% of
Gemma-2-2B's kernel time at 16k tokens a step on an H200, and moved 0.9-1.4 TB/s on its own;
this one moves 2.8-3.7 TB/s, 2.3-2.7x faster (``benchmarks/gemma_mlp.py``,
docs/benchmarks/gpu-families.md). A program takes one token's block of columns, and the GELU is
computed as ``x * sigmoid(2u)``: the same function as ``0.5 x (1 + tanh(u))``, from one
exponential.

The same GELU also follows a bias in place (:func:`bias_gelu_tanh_`): a batch-invariant
forward multiplies in tiles without cuBLASLt's bias + GELU epilogue, and eager, the bias and
the GELU took two more passes over the [tokens, intermediate] activation.

Rounding follows the eager ops it replaces: the GELU rounded to the model's dtype, then the
product. Where the two fp32 GELUs straddle a rounding boundary, a result sits one ulp from
torch's; and for x below about -3.5 torch's ``1 + tanh(u)`` cancels in fp32 (its GELU of -6.3 is
-0.0, the function's value -3e-12) where this form keeps the value: there the two differ by
far less than the dtype's resolution at the activations' scale. ``agrees`` bounds both.
"""

from __future__ import annotations

import torch

from .triton_support import INTERPRETING, tl, triton

_TL_DTYPES = {}
if triton is not None:
    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

    @triton.jit
    def _rounded(x, DTYPE: tl.constexpr, EXACT_CAST: tl.constexpr):
        """fp32 -> DTYPE -> fp32, nearest-even as torch rounds. The GPU's cast does that; the
        interpreter's bf16 cast truncates, so there it is done in integer arithmetic."""
        if DTYPE == tl.bfloat16 and not EXACT_CAST:  # noqa: SIM300 - constexpr arguments
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        return x.to(DTYPE).to(tl.float32)

    @triton.jit
    def _gelu_tanh(x):
        """0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2 / pi) * (x + 0.044715 x^3), fp32."""
        two_u = 1.5957691216057308 * (x + 0.044715 * x * x * x)
        return x / (1.0 + tl.exp(-two_u))

    @triton.jit
    def _gated_kernel(
        gate_up_ptr,  # [T, 2 I]: gate | up
        out_ptr,  # [T, I]
        stride_in,
        stride_out,
        width,  # I
        BLOCK: tl.constexpr,
        DTYPE: tl.constexpr,
        EXACT_CAST: tl.constexpr,
        SILU: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        src = gate_up_ptr + row * stride_in + cols
        gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(src + width, mask=mask, other=0.0).to(tl.float32)
        if SILU:  # x * sigmoid(x)
            act = _rounded(gate / (1.0 + tl.exp(-gate)), DTYPE, EXACT_CAST)
        else:
            act = _rounded(_gelu_tanh(gate), DTYPE, EXACT_CAST)
        out = _rounded(act * up, DTYPE, EXACT_CAST)
        tl.store(out_ptr + row * stride_out + cols, out.to(DTYPE), mask=mask)

    @triton.jit
    def _bias_kernel(
        y_ptr,  # [T, N], written in place
        bias_ptr,  # [N]
        stride,
        width,  # N
        BLOCK: tl.constexpr,
        DTYPE: tl.constexpr,
        EXACT_CAST: tl.constexpr,
        GELU: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        ptr = y_ptr + row * stride + cols
        y = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        bias = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        out = _rounded(y + bias, DTYPE, EXACT_CAST)  # as the eager addition rounds it
        if GELU:
            out = _rounded(_gelu_tanh(out), DTYPE, EXACT_CAST)
        tl.store(ptr, out.to(DTYPE), mask=mask)


_BLOCK = 1024
_WARPS = 4


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel runs here: Triton on CUDA (or its interpreter), a float dtype."""
    return triton is not None and (device.type == "cuda" or INTERPRETING) and dtype in _TL_DTYPES


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` for ``gate_up`` = [T, 2 I] (gate | up along the
    last dim, rows contiguous): [T, I] in gate_up's dtype."""
    return _gated(gate_up, silu=False)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` = [T, 2 I]: [T, I] in gate_up's dtype."""
    return _gated(gate_up, silu=True)


def bias_gelu_tanh_(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``y`` [T, N] (rows contiguous) replaced by ``gelu(y + bias, approximate="tanh")``, the
    sum rounded to ``y``'s dtype first as the eager addition does; returns ``y``."""
    return _bias(y, bias, gelu=True)


def add_bias_(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``y`` [T, N] (rows contiguous) replaced by ``y + bias``, the eager addition's bits (whose
    broadcast of the bias runs torch's unvectorised kernel: 22% of a batch-invariant MiniLM
    step's GPU time on an H100, its largest item); returns ``y``."""
    return _bias(y, bias, gelu=False)


def _bias(y: torch.Tensor, bias: torch.Tensor, *, gelu: bool) -> torch.Tensor:
    assert y.dim() == 2 and y.stride(1) == 1, "rows of contiguous columns"
    tokens, width = y.shape
    if tokens:
        _bias_kernel[(tokens, triton.cdiv(width, _BLOCK))](
            y, bias.contiguous(), y.stride(0), width,
            BLOCK=_BLOCK, DTYPE=_TL_DTYPES[y.dtype], EXACT_CAST=not INTERPRETING, GELU=gelu,
            num_warps=_WARPS,
        )  # fmt: skip
    return y


def _gated(gate_up: torch.Tensor, *, silu: bool) -> torch.Tensor:
    tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    out = gate_up.new_empty((tokens, width))
    if tokens == 0:
        return out
    _gated_kernel[(tokens, triton.cdiv(width, _BLOCK))](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        width,
        BLOCK=_BLOCK,
        DTYPE=_TL_DTYPES[gate_up.dtype],
        EXACT_CAST=not INTERPRETING,
        SILU=silu,
        num_warps=_WARPS,
    )
    return out


def reference(gate_up: torch.Tensor, *, silu: bool = False) -> torch.Tensor:
    """The eager ops the kernel replaces."""
    gate, up = gate_up.chunk(2, -1)
    if silu:
        return torch.nn.functional.silu(gate) * up
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def agrees(eager: torch.Tensor, fused: torch.Tensor) -> bool:
    """Whether the kernel's output is the eager ops' to one rounding step of a 16-bit dtype (to
    a few ulps in fp32, whose exponential and division differ in their last bits), or to 1e-4
    (1e-6 in fp32) where torch's GELU cancels."""
    fp32 = eager.dtype == torch.float32
    atol, rtol = (
        (1e-6, 4 * torch.finfo(eager.dtype).eps) if fp32 else (1e-4, torch.finfo(eager.dtype).eps)
    )
    return torch.allclose(eager.float(), fused.float(), rtol=rtol, atol=atol)
