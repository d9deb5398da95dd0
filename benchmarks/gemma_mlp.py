"""Gemma's MLP on the GPU: the GeGLU Triton kernel (``layers/gated_gelu.py``) against inductor's
kernel for the same ops, alone and inside a layer's whole post-attention part.

    python3 benchmarks/gemma_mlp.py [--config configs/gemma-2-2b.json] [--tokens 4096,16384]

Per token count, bf16, random weights at the config's sizes, median of --iters timed calls
(CUDA events) after warm-up:
1. GeGLU alone: ``gelu(gate, approximate="tanh") * up`` from the fused gate|up projection, as
   the engine compiles it (``compile_layer_fn``, dynamic in the tokens, rounded like eager) and
   as the Triton kernel: ms, and GB/s of the bytes it must move;
2. the post-attention part of a layer (o_proj, the norms, the residuals, gate|up, GeGLU, down):
   compiled whole, against the two compiled parts around the kernel, and compiled whole with
   the GELU written as ``x * sigmoid(2u)`` in fp32 (inductor's kernel without tanh);
and how far the two outputs are apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from pipepool.layers import gated_gelu
from pipepool.models.base import compile_layer_fn
from pipepool.models.gemma import (
    GemmaConfig,
    MlpWeights,
    attention_residual_and_gate_up,
    mlp_residual,
    post_attention,
)

HERE = Path(__file__).parent


def timed(fn, iters: int) -> float:
    """Median ms of ``fn()`` over ``iters`` calls, after three warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(HERE / "configs" / "gemma-2-2b.json"))
    parser.add_argument("--tokens", default="4096,16384")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    hf = json.loads(Path(args.config).read_text())
    cfg = GemmaConfig.from_hf(hf, "gemma2")
    hidden, inter, q_dim = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, device=dev, generator=gen) * scale).to(dt)

    w = MlpWeights(
        rand(hidden, q_dim), None, rand(hidden), rand(hidden), rand(2 * inter, hidden),
        rand(hidden, inter), rand(hidden),
    )  # fmt: skip
    compiled_geglu = compile_layer_fn(gated_gelu.reference, round_like_eager=True)
    whole = compile_layer_fn(post_attention, round_like_eager=True)
    mlp_in = compile_layer_fn(attention_residual_and_gate_up, round_like_eager=True)
    mlp_out = compile_layer_fn(mlp_residual, round_like_eager=True)

    def sigmoid_form(cfg, x: torch.Tensor, attn: torch.Tensor, w: MlpWeights) -> torch.Tensor:
        x, gate_up = attention_residual_and_gate_up(cfg, x, attn, w)
        gate, up = gate_up.float().chunk(2, -1)
        two_u = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)
        act = (gate * torch.sigmoid(two_u)).to(x.dtype).float()
        return mlp_residual(cfg, x, (act * up).to(x.dtype), w)

    whole_sigmoid = compile_layer_fn(sigmoid_form, round_like_eager=True)

    def split(x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x, gate_up = mlp_in(cfg, x, attn, w)
        return mlp_out(cfg, x, gated_gelu.gelu_tanh_and_mul(gate_up), w)

    name = torch.cuda.get_device_name()
    print(f"{args.config}: hidden {hidden}, intermediate {inter}, bf16, {name}")

    def measure(tokens: int) -> None:
        gate_up = rand(tokens, 2 * inter, scale=1.0)
        moved = gate_up.numel() * 2 + tokens * inter * 2  # read gate|up, write the product
        ms_inductor = timed(lambda: compiled_geglu(gate_up), args.iters)
        ms_kernel = timed(lambda: gated_gelu.gelu_tanh_and_mul(gate_up), args.iters)
        want, got = compiled_geglu(gate_up), gated_gelu.gelu_tanh_and_mul(gate_up)
        print(
            f"T={tokens} GeGLU alone: inductor {ms_inductor:.3f} ms "
            f"({moved / ms_inductor / 1e6:.0f} GB/s), Triton {ms_kernel:.3f} ms "
            f"({moved / ms_kernel / 1e6:.0f} GB/s): {ms_inductor / ms_kernel:.2f}x; "
            f"unequal {(want != got).float().mean().item():.2e}, "
            f"agrees {gated_gelu.agrees(want, got)}",
            flush=True,
        )
        x, attn = rand(tokens, hidden, scale=1.0), rand(tokens, q_dim, scale=1.0)
        ms_whole = timed(lambda: whole(cfg, x, attn, w), args.iters)
        ms_split = timed(lambda: split(x, attn), args.iters)
        ms_sigmoid = timed(lambda: whole_sigmoid(cfg, x, attn, w), args.iters)
        a, b = whole(cfg, x, attn, w).float(), split(x, attn).float()
        c = whole_sigmoid(cfg, x, attn, w).float()
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()
        cos_c = torch.nn.functional.cosine_similarity(a, c, dim=-1).min().item()
        print(
            f"T={tokens} post-attention: compiled whole {ms_whole:.3f} ms, parts + kernel "
            f"{ms_split:.3f} ms: {ms_whole / ms_split:.3f}x (min cos per token {cos:.6f}); "
            f"whole, GELU as x * sigmoid(2u) in fp32 {ms_sigmoid:.3f} ms: "
            f"{ms_whole / ms_sigmoid:.3f}x (min cos {cos_c:.6f})",
            flush=True,
        )

    with torch.inference_mode():
        for tokens in map(int, args.tokens.split(",")):
            measure(tokens)


if __name__ == "__main__":
    main()
