"""invariant_tiles: launch counts, the tiled product and its check, on the CPU (the CUDA
figures and bit-equality under cuBLAS are in tests/test_batch_invariance_gpu.py; issue 60)."""

from __future__ import annotations

import pytest
import torch

from pipepool.layers import invariant_tiles
from pipepool.layers.invariant_tiles import launch_counts, tiled_matmul, tiles_agree


@pytest.mark.parametrize(
    ("tiles", "max_tiles", "want"),
    [
        (0, 64, []), (1, 64, [1]), (64, 64, [64]), (65, 64, [64, 1]), (100, 64, [64, 36]),
        (200, 64, [64, 64, 64, 8]), (5, None, [5]), (0, None, []),
    ],
)  # fmt: skip
def test_launch_counts_never_pass_the_checked_bound(tiles, max_tiles, want):
    counts = launch_counts(tiles, max_tiles)
    assert counts == want
    assert sum(counts) == tiles


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 100, 333])
def test_tiled_matmul_is_the_product_and_each_row_its_own_bits(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(40, 24, generator=gen)
    x = torch.randn(rows, 24, generator=gen)
    out = tiled_matmul(x, weight.t(), tile_rows=16, max_tiles=4)
    assert out.shape == (rows, 40)
    torch.testing.assert_close(out, x @ weight.t(), rtol=1e-5, atol=1e-5)
    for i in {0, rows // 2, rows - 1}:
        alone = tiled_matmul(x[i : i + 1], weight.t(), tile_rows=16, max_tiles=4)
        assert torch.equal(alone, out[i : i + 1]), i


def test_tiled_matmul_takes_rows_that_are_not_contiguous():
    x = torch.randn(50, 48)[:, :24]
    weight = torch.randn(8, 24)
    torch.testing.assert_close(tiled_matmul(x, weight.t(), 16), x @ weight.t())


def test_the_check_passes_for_a_gemm_whose_tiles_agree():
    assert tiles_agree(24, 40, torch.float32, torch.device("cpu"), tile_rows=16, max_tiles=8)


def test_the_check_fails_when_a_tile_depends_on_its_batch(monkeypatch):
    """A batched GEMM whose tiles get other bits in a launch of several (as a library that
    chose its kernel by batch count could) fails the check."""
    real = torch.bmm

    def drifting(a, b, **kwargs):
        out = real(a, b, **kwargs)
        return out * (1 + 1e-6) if a.shape[0] > 1 else out

    monkeypatch.setattr(torch, "bmm", drifting)
    assert not tiles_agree(24, 40, torch.float32, torch.device("cpu"), tile_rows=16, max_tiles=8)


def test_the_cuda_check_is_made_once_per_shape(monkeypatch):
    calls = []

    def counted(*args):
        calls.append(args)
        return True

    monkeypatch.setattr(invariant_tiles, "tiles_agree", counted)
    monkeypatch.setattr(invariant_tiles, "_agree", {})
    for _ in range(3):
        assert invariant_tiles.cuda_tiles_agree(24, 40, torch.float16, torch.device("cpu"))
    assert invariant_tiles.cuda_tiles_agree(24, 8, torch.float16, torch.device("cpu"))
    assert len(calls) == 2


def test_check_linears_leaves_cpu_layers_alone(monkeypatch):
    """The load-time check is for CUDA linear layers in a tiled dtype only: a CPU model asks
    nothing (the CUDA side runs in tests/test_batch_invariance_gpu.py's engines)."""
    asked = []
    monkeypatch.setattr(invariant_tiles, "cuda_tiles_agree", lambda *a: asked.append(a) or True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16))
    invariant_tiles.check_linears(model)
    assert asked == []  # on the CPU: nothing to check
