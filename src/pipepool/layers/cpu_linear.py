"""Linear layers with fused epilogues on the CPU, through oneDNN.

``torch.ops.mkldnn._linear_pointwise`` applies the bias, an activation (GELU) or a residual add
while each output block of the GEMM is still in registers, where ``F.linear`` + ``F.gelu`` +
``x + y`` write and re-read the whole output once per op. With weights reordered once into
oneDNN's blocked layout, an encoder's post-attention block (output projection + residual,
FFN in + GELU, FFN out + residual) ran 15% faster than the eager ops (MiniLM shapes, 2048
rows, fp32, 2 Sapphire Rapids cores, torch 2.13), with identical GELU outputs.

In 16 bits only the bias stays in the epilogue: an eager model (transformers) rounds the
product to bf16 before its activation or residual add, and the epilogue would apply them to
the fp32 accumulator instead, a rounding point the checkpoint's reference does not have
(with it a bf16 decoder layer differs from transformers' by an ulp on some elements; rounded
as transformers rounds, it is transformers' bit for bit: docs/parity.md).

The ops are internal to PyTorch (inductor's CPU backend emits them), so :func:`supported` checks
once that they exist and agree with the eager ops before any model uses them; where they do
not (other builds, other versions), callers keep the eager path.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .activation import ACTIVATIONS

# Activation name (layers/activation.py) -> oneDNN post-op (attr, algorithm).
_POST_OPS: dict[str, tuple[str, str | None]] = {
    "identity": ("none", None),
    "relu": ("relu", None),
    "gelu": ("gelu", "none"),
    "gelu_new": ("gelu", "tanh"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
}


def fusable(activation: str) -> bool:
    return activation in _POST_OPS


@functools.cache
def packs(dtype: torch.dtype) -> bool:
    """Whether linear layers in ``dtype`` go through these ops here: fp32, and bf16 where the
    CPU computes it natively (AVX-512 BF16 or AMX), the ops present and checked."""
    if dtype == torch.bfloat16 and not native_half(dtype):
        return False
    return dtype in (torch.float32, torch.bfloat16) and supported(dtype)


@functools.cache
def native_half(dtype: torch.dtype) -> bool:
    """Whether this CPU computes ``dtype`` (bfloat16 or float16) natively (AVX-512 BF16 / FP16
    or AMX, as oneDNN detects them); without, every half-precision matmul is emulated."""
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    check = getattr(torch.ops.mkldnn, f"_is_mkldnn_{name}_supported", None)
    return bool(check is not None and check())


@functools.cache
def supported(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the fused ops exist here and match the eager ones on a random batch in
    ``dtype`` (bf16: within its rounding, against the eager ops in fp32 on the same inputs)."""
    try:
        ops = torch.ops.mkldnn
        if not torch.backends.mkldnn.is_available():
            return False
        gen = torch.Generator().manual_seed(0)
        x, res = torch.randn(37, 64, generator=gen), torch.randn(37, 48, generator=gen)
        w, b = torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen)
        x, res, w, b = (t.to(dtype).float() for t in (x, res, w, b))  # the inputs both see
        with torch.inference_mode():
            packed = ops._reorder_linear_weight(w.to(dtype), None)
            xd, rd, bd = x.to(dtype), res.to(dtype), b.to(dtype)
            checks = [
                (linear(xd, packed, bd, "gelu"), F.gelu(F.linear(x, w, b))),
                (linear(xd, packed, bd, "gelu_new"), F.gelu(F.linear(x, w, b), approximate="tanh")),
                (linear_add(xd, rd, packed, bd), F.linear(x, w, b) + res),
            ]
        fp32 = dtype == torch.float32
        return all(
            a.dtype == dtype
            and torch.allclose(
                a.float(),
                e,
                rtol=1e-5 if fp32 else 2**-7,
                atol=1e-5 if fp32 else 2**-7 * float(e.abs().max()),
            )
            for a, e in checks
        )
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] reordered once into oneDNN's layout (an opaque mkldnn tensor, an
    extra copy of the weight kept alongside the module's own)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


class PackedWeights:
    """oneDNN copies (:func:`pack`) of a module's weights, packed on first use and again
    whenever one of them was written since (its storage or version counter moved)."""

    def __init__(self) -> None:
        self._key: tuple[tuple[int, int], ...] | None = None
        self._packed: tuple[torch.Tensor, ...] = ()

    def of(self, *sources: torch.Tensor) -> tuple[torch.Tensor, ...]:
        key = tuple((t.data_ptr(), _version(t)) for t in sources)
        if key != self._key:
            self._packed = tuple(pack(t) for t in sources)
            self._key = key
        return self._packed


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor (made under inference_mode) has no counter
        return -1


def linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, activation: str = "identity"
) -> torch.Tensor:
    """activation(x @ W.T + bias); ``activation`` must be :func:`fusable`. In 16 bits the
    activation applies to the product rounded to ``x``'s dtype, as the eager ops apply it."""
    if x.dtype != torch.float32 and activation != "identity":
        return ACTIVATIONS[activation](linear(x, packed, bias))
    attr, algorithm = _POST_OPS[activation]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, attr, [], algorithm)


def linear_add(
    x: torch.Tensor, residual: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ W.T + bias + residual: the add done in the GEMM's epilogue in fp32; in 16 bits
    to the product rounded to ``x``'s dtype, as the eager ops add it."""
    if x.dtype != torch.float32:
        return residual + linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add")
