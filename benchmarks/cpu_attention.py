"""CPU attention on the small groups a step of short texts makes (issue 10's CPU target).

    python benchmarks/cpu_attention.py

For groups of ``n`` requests of ``L`` tokens (12 heads of 32, fp32, bidirectional, laid out as
the packed batch leaves them), microseconds per call and GFLOP/s of PyTorch's SDPA (its CPU
flash kernel), of matmul-softmax-matmul, and of SDPA's math path, on torch's threads and on one.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, HEAD_DIM = 12, 32
GROUPS = ((1, 16), (2, 34), (4, 34), (2, 60), (16, 34), (60, 34))


def microseconds(fn, reps: int = 300) -> float:
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e6


def main() -> None:
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads")
    with torch.inference_mode():
        for n, length in GROUPS:
            qkv = torch.randn(n, length, 3 * HEADS, HEAD_DIM)
            q, k, v = (qkv[:, :, i * HEADS : (i + 1) * HEADS].transpose(1, 2) for i in range(3))

            def sdpa(q=q, k=k, v=v):
                return F.scaled_dot_product_attention(q, k, v)

            def manual(q=q, k=k, v=v):
                scores = torch.matmul(q, k.transpose(-1, -2)) * HEAD_DIM**-0.5
                return torch.matmul(torch.softmax(scores, -1), v)

            flops = 4 * n * HEADS * length * length * HEAD_DIM
            times = {"sdpa": microseconds(sdpa), "matmuls": microseconds(manual)}
            with sdpa_kernel(SDPBackend.MATH):
                times["sdpa math"] = microseconds(sdpa)
            torch.set_num_threads(1)
            times["sdpa 1 thread"] = microseconds(sdpa)
            torch.set_num_threads(threads)
            cells = ", ".join(f"{k} {us:.1f} us ({flops / us / 1e3:.1f} GFLOP/s)"
                              for k, us in times.items())  # fmt: skip
            print(f"n={n} L={length}: {cells}")


if __name__ == "__main__":
    main()
