"""The batch-invariant Triton GEMM's tiles against cuBLAS, layer by layer (issue 60;
docs/batch-invariance.md): which fixed tile configuration is fastest for each linear layer
shape of the MiniLM and Qwen3-0.6B shapes, and whether each keeps a row's bits whatever M.

    python benchmarks/invariant_gemm.py                      # both models, M = 2048 and 8192
    python benchmarks/invariant_gemm.py --models 0.6b --rows 512,4096,16384

For every (K, N) of a model's layers and every M, each candidate of ``CONFIGS`` (BLOCK_M,
BLOCK_N, BLOCK_K, warps, stages) is timed on the Triton kernel of ``layers/invariant_triton``
(CUDA events, 30 launches after 3 warm-ups) beside ``F.linear`` (cuBLAS), and checked: rows
0..r of the full product equal the product of those rows alone (r = 1, 37, 300), bit for bit.
A configuration may differ per (K, N), never per M: that is what keeps a row invariant. The
current one (``invariant_triton.TILES``) is marked. Each shape also shows cuBLAS in the
engine's fixed row tiles (``layers/invariant_tiles``, used where its check passes) and the
check's verdict.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from pipepool.layers import invariant_tiles, invariant_triton
from pipepool.layers.triton_support import triton

# (K, N) of each linear layer: QKV, attention output, MLP up (gate and up fused for Qwen3), down.
SHAPES = {
    "minilm": [(384, 1152), (384, 384), (384, 1536), (1536, 384)],
    "0.6b": [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)],
}
CONFIGS = [
    (128, 128, 64, 8, 3), (128, 128, 64, 4, 3), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4),
    (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (128, 64, 64, 4, 4),
    (64, 128, 64, 4, 4), (128, 128, 32, 4, 5), (64, 256, 64, 8, 4), (128, 256, 32, 8, 4),
]  # fmt: skip
CHECK_ROWS = (1, 37, 300)


def launch(a: torch.Tensor, b: torch.Tensor, config: tuple) -> torch.Tensor:
    """``a @ b`` on the invariant kernel with one tile configuration."""
    block_m, block_n, block_k, warps, stages = config
    m, k = a.shape
    n = b.shape[1]
    out = a.new_empty((m, n))
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    invariant_triton._matmul_kernel[grid](
        a, b, a, out, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        out.stride(0), out.stride(1), HAS_BIAS=False, IEEE=False, EVEN_K=k % block_k == 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP=invariant_triton.GROUP_M,
        LOOP_AS_WHILE=False, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def milliseconds(fn, launches: int = 30) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(launches):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / launches


def tiled_cublas(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` as the engine multiplies bf16 on CUDA where the check passes."""
    return invariant_tiles.tiled_matmul(
        a, b, invariant_tiles.CUDA_TILE_ROWS, invariant_tiles.MAX_LAUNCH_TILES
    )


def invariant(a: torch.Tensor, b: torch.Tensor, config: tuple) -> bool:
    full = launch(a, b, config)
    return all(torch.equal(full[:r], launch(a[:r].contiguous(), b, config)) for r in CHECK_ROWS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="minilm,0.6b")
    parser.add_argument("--rows", default="2048,8192", help="M values (a step's tokens)")
    parser.add_argument("--top", type=int, default=4, help="configurations printed per shape")
    args = parser.parse_args()
    current = invariant_triton.TILES[torch.bfloat16]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for model in args.models.split(","):
        for k, n in SHAPES[model]:
            weight = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
            for m in map(int, args.rows.split(",")):
                a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                report(f"{model} K={k} N={n} M={m}", a, weight, current, args.top)


def report(label: str, a: torch.Tensor, weight: torch.Tensor, current: tuple, top: int) -> None:
    """One (K, N, M): cuBLAS, the ``top`` fastest configurations and the current one."""
    m, k = a.shape
    n = weight.shape[0]
    cublas = milliseconds(lambda: F.linear(a, weight))
    flop = 2 * m * k * n
    rows = []
    for config in CONFIGS:
        try:
            ms = milliseconds(lambda c=config: launch(a, weight.t(), c))
            same: bool | str = invariant(a, weight.t(), config)
        except Exception as exc:  # a tile that does not fit this GPU
            ms, same = float("inf"), f"failed: {type(exc).__name__}"
        rows.append((ms, config, same))
    rows.sort(key=lambda row: row[0])
    print(f"{label}: cuBLAS {cublas * 1e3:.1f} us ({flop / cublas / 1e9:.0f} TFLOP/s)", flush=True)
    tiled = milliseconds(lambda: tiled_cublas(a, weight.t()))
    agree = invariant_tiles.cuda_tiles_agree(k, n, a.dtype, a.device)
    print(
        f"    cuBLAS in {invariant_tiles.CUDA_TILE_ROWS}-row tiles: {tiled * 1e3:.1f} us, "
        f"{cublas / tiled:.2f}x cuBLAS, its check {'passes' if agree else 'fails'}",
        flush=True,
    )
    for ms, config, same in rows[:top] + [r for r in rows[top:] if r[1] == current]:
        mark = " (current)" if config == current else ""
        print(
            f"    {config}{mark}: {ms * 1e3:.1f} us, {flop / ms / 1e9:.0f} TFLOP/s, "
            f"{cublas / ms:.2f}x cuBLAS, invariant {same}",
            flush=True,
        )


if __name__ == "__main__":
    main()
