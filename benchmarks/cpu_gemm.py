"""GFLOP/s of the CPU's linear layers, three ways, on the shapes of all-MiniLM-L6-v2 and
Qwen3-0.6B: ``F.linear`` (MKL's addmm), ``torch.mm`` on the transposed weight, and oneDNN's
``_linear_pointwise`` on a weight packed once (what ``layers/cpu_linear.py`` runs).

    python benchmarks/cpu_gemm.py [--threads 2] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

# (rows, in, out): MiniLM's q|k|v, FFN in and out at a 2048-token step; Qwen3-0.6B's q|k|v,
# gate|up and down at 512 rows (its tiles), and gate|up at 2048.
SHAPES = [
    (2048, 384, 1152),
    (2048, 384, 1536),
    (2048, 1536, 384),
    (512, 1024, 4096),
    (512, 1024, 6144),
    (512, 3072, 1024),
    (2048, 1024, 6144),
]


def seconds(fn, repeats: int = 20) -> float:
    fn()
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def _times(rows: int, n_in: int, n_out: int, dtype: torch.dtype) -> list[float]:
    """Seconds a call: F.linear, torch.mm, oneDNN packed."""
    x = torch.randn(rows, n_in, dtype=dtype)
    w, b = torch.randn(n_out, n_in, dtype=dtype), torch.randn(n_out, dtype=dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    return [
        seconds(lambda: F.linear(x, w, b)),
        seconds(lambda: torch.mm(x, w.t())),
        seconds(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], None)),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"{args.threads} threads, {args.dtype}, GFLOP/s")
    print(f"{'rows x in -> out':>22} {'F.linear':>9} {'mm':>9} {'oneDNN packed':>14}")
    with torch.inference_mode():
        for rows, n_in, n_out in SHAPES:
            rates = [2 * rows * n_in * n_out / t / 1e9 for t in _times(rows, n_in, n_out, dtype)]
            shape = f"{rows} x {n_in} -> {n_out}"
            print(f"{shape:>22} {rates[0]:9.1f} {rates[1]:9.1f} {rates[2]:14.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
