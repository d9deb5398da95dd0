"""Variable-length attention kernels on one step's worth of requests, on a CUDA device.

    python benchmarks/attention_kernels.py            # flash against triton (default tiles)
    python benchmarks/attention_kernels.py --sweep    # and every tile in TILE_SWEEP

Steps (bf16, random q/k/v), as the engine would pack them with its default budgets:
- all-MiniLM-L6-v2 shape (12 heads of 32, bidirectional), W1 lengths (uniform 16-512) and W4
  lengths (log-normal, median 32) up to 32,768 tokens;
- Qwen3-0.6B shape (16 query heads, 8 KV heads of 128, causal), W1 lengths up to 16,384 tokens.

Printed per kernel: microseconds per call, TFLOP/s of useful work (QK^T and PV of each request,
halved for causal masks) and the largest absolute difference from the flash kernel's output.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from pipepool.layers.triton_attention import TILES, varlen_attention, work_list

TILE_SWEEP = {
    32: ((128, 64, 4, 2), (128, 128, 4, 2), (64, 64, 4, 2), (128, 64, 4, 3), (64, 128, 4, 2),
         (128, 32, 4, 2), (128, 64, 8, 2), (64, 32, 4, 2), (64, 32, 4, 3), (128, 32, 4, 3)),
    128: ((128, 64, 8, 2), (128, 64, 4, 2), (64, 64, 4, 2), (128, 128, 8, 2), (128, 32, 4, 2),
          (64, 32, 4, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 3)),
}  # fmt: skip
STEPS = (
    # label, lengths, budget, query heads, KV heads, head size, causal
    ("MiniLM W1", "W1", 32768, 12, 12, 32, False),
    ("MiniLM W4", "W4", 32768, 12, 12, 32, False),
    ("Qwen3-0.6B W1", "W1", 16384, 16, 8, 128, True),
)


def step_lengths(kind: str, budget: int) -> np.ndarray:
    """The first requests of a workload that fit in one step of ``budget`` tokens."""
    rng = np.random.default_rng(0)
    if kind == "W1":
        lengths = rng.integers(16, 513, size=4096)
    else:
        drawn = np.rint(rng.lognormal(np.log(32), 0.8, size=8192))
        lengths = np.clip(drawn, 4, 256).astype(np.int64)
    return lengths[: int(np.searchsorted(np.cumsum(lengths), budget, side="right"))]


def microseconds(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e6


def bench_step(kind: str, budget: int, hq: int, hkv: int, d: int, causal: bool, sweep: bool):
    """Time flash and the Triton kernel on one step; print one line per kernel."""
    lengths = step_lengths(kind, budget)
    tokens = int(lengths.sum())
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32).cuda()
    longest = int(lengths.max())
    q = torch.randn(tokens, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(tokens, hkv, d, device="cuda", dtype=torch.bfloat16)
    scale = d**-0.5
    flops = 4 * hq * d * float((lengths.astype(np.float64) ** 2).sum()) / (2 if causal else 1)

    def flash():
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, longest, longest, 0.0, causal, False, scale=scale,
            window_size_left=-1, window_size_right=0 if causal else -1,
        )[0]  # fmt: skip

    cu_host = np.concatenate([[0], np.cumsum(lengths)])
    works = {}  # per BLOCK_M: the work list the runner uploads with an encoder's step

    def triton(tile):
        if causal:  # decoders launch a grid from the step
            return varlen_attention(q, k, v, cu, cu, longest, causal=True, scale=scale, tile=tile)
        block_m = (tile or TILES[d])[0]
        if block_m not in works:
            host = work_list(cu_host, block_m)
            works[block_m] = (torch.from_numpy(host).cuda(), int(host[0]))
        work, programs = works[block_m]
        return varlen_attention(
            q, k, v, cu, cu, longest, causal=False, scale=scale, tile=tile, work=work,
            programs=programs,
        )  # fmt: skip

    want = flash().float()
    kernels = {"flash (aten)": flash}
    for tile in (None, *(TILE_SWEEP.get(d, ()) if sweep else ())):
        kernels[f"triton {tile or 'default'}"] = lambda tile=tile: triton(tile)
    print(f"   {len(lengths)} requests, {tokens} tokens, longest {longest}, "
          f"{flops / 1e9:.1f} GFLOP")  # fmt: skip
    for name, fn in kernels.items():
        diff = (fn().float() - want).abs().max().item()
        us = microseconds(fn)
        print(f"   {name:34s} {us:8.1f} us {flops / us / 1e6:7.1f} TFLOP/s  diff {diff:.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="time every tile of TILE_SWEEP")
    args = parser.parse_args()
    torch.manual_seed(0)
    for label, *step in STEPS:
        print(label)
        bench_step(*step, sweep=args.sweep)


if __name__ == "__main__":
    main()
