"""The segment-sum kernel MEAN pooling uses on CUDA, against index_add_ of the same rows: in
Triton's interpreter on the CPU (fp32), on a GPU in bf16. Ranges of every kind: empty, one
row, shorter and longer than the kernel's row block, not in order, some rows in none."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import check_of, run_interpreted

pytest.importorskip("triton")

_CASE = r"""
import numpy as np
import torch
from pipepool.layers.segment_sum import segment_sums


def check(device, dtype, width, tol):
    torch.manual_seed(0)
    x = torch.randn(300, width, device=device).to(dtype)
    starts = np.array([250, 0, 7, 40, 100, 299])
    lens = np.array([50, 1, 33, 0, 16, 1])
    bounds = torch.from_numpy(np.concatenate([starts, lens])).to(device)
    got = segment_sums(x, bounds)
    want = torch.zeros(len(starts), width, dtype=torch.float64)
    for j, (s, n) in enumerate(zip(starts, lens)):
        want[j] = x[s : s + n].double().sum(0).cpu()
    assert got.dtype == torch.float32 and got.shape == (len(starts), width)
    err = (got.double().cpu() - want).abs().max().item()
    assert err < tol, err
    assert segment_sums(x, bounds[:0]).shape == (0, width)
    print("ok")
"""


def test_segment_sums_in_the_interpreter():
    script = _CASE + "\ncheck('cpu', torch.float32, 200, 1e-4)\n"
    run_interpreted(script, timeout=300)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("width", [384, 4096, 200])
def test_segment_sums_on_the_gpu(width):
    check_of(_CASE)("cuda", torch.bfloat16, width, 1e-4)
