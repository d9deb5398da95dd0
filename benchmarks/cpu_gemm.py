"""GFLOP/s of an encoder's linear layers on the CPU, each way the engine or a peer runs them.

    python benchmarks/cpu_gemm.py [--model minilm|qwen3-0.6b] [--rows 2048,4096]

For the shapes of all-MiniLM-L6-v2 (hidden 384, intermediate 1536) or Qwen3-0.6B (hidden
1024, 16 + 2 x 8 heads of 128, intermediate 3072), fp32: ``F.linear`` (what
sentence-transformers runs), oneDNN's packed linear alone and with its fused GELU or residual
add (``layers/cpu_linear.py``, what the engine runs for every projection), ``F.linear`` +
``F.gelu``, and ``addmm`` on a pre-transposed weight (MKL).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from pipepool.commands.cpu_ceiling import seconds
from pipepool.layers import cpu_linear

# (in, out) of each projection: q|k|v, attention output, FFN in (gate|up), FFN out (down)
SHAPES = {
    "minilm": ((384, 1152), (384, 384), (384, 1536), (1536, 384)),
    "qwen3-0.6b": ((1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)),
}


def rates(m: int, k: int, n: int) -> str:
    """GFLOP/s of an [m, k] x [k, n] linear layer, each way."""
    x, w, b = torch.randn(m, k), torch.randn(n, k) / 20, torch.randn(n)
    residual, packed, w_t = torch.randn(m, n), cpu_linear.pack(w), w.t().contiguous()
    ways = {
        "F.linear": lambda: F.linear(x, w, b),
        "oneDNN": lambda: cpu_linear.linear(x, packed, b),
        "oneDNN+gelu": lambda: cpu_linear.linear(x, packed, b, "gelu"),
        "linear,gelu": lambda: F.gelu(F.linear(x, w, b)),
        "oneDNN+add": lambda: cpu_linear.linear_add(x, residual, packed, b),
        "addmm": lambda: torch.addmm(b, x, w_t),
    }
    gflop = 2 * m * k * n / 1e9
    return " | ".join(f"{name} {gflop / seconds(fn, repeats=20):.0f}" for name, fn in ways.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="minilm")
    parser.add_argument("--rows", default="2048,4096", help="rows of a GEMM (a CPU tile: 2048)")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; GFLOP/s")
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            for k, n in SHAPES[args.model]:
                print(f"{m}x{k} @ {k}x{n}: {rates(m, k, n)}")


if __name__ == "__main__":
    main()
