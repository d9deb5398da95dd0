"""bf16 matmul rate of every visible GPU, one at a time (8192^3):
tells a GPU that is slower on its own from one slowed down by its neighbour."""

from __future__ import annotations

import time

import torch


def rate(device: torch.device, n: int = 8192, repeats: int = 20) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


if __name__ == "__main__":
    for k in range(torch.cuda.device_count()):
        print(f"cuda:{k} bf16 matmul {rate(torch.device('cuda', k)):.0f} TFLOP/s", flush=True)
