"""batch_invariant on a GPU (bf16): a text's vector is the same bits alone and inside a
shuffled batch, at budgets 256 and 16384, with CUDA graphs on and off, on one replica or
two; for the bundled MiniLM and a tiny Qwen3 built here (head size 32, which the Triton
attention kernel runs). Skipped where there is no CUDA device (issue 60)."""

from __future__ import annotations

import numpy as np
import pytest
import tiny_models
import torch
from test_batch_invariance import OTHERS, TARGETS, _alone_and_in_batch, _assert_bit_equal

import pipepool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GPU = {"device": "cuda", "dtype": "bfloat16", "batch_invariant": True}


def _dp2() -> dict:
    """Two replicas: one GPU each where there are two, else both on the one GPU."""
    return {"data_parallel_size": 2, "replicas_per_gpu": 1 if torch.cuda.device_count() > 1 else 2}


@pytest.fixture(scope="module")
def minilm_budget256(minilm_path):
    with pipepool.Engine(str(minilm_path), max_num_batched_tokens=256, **GPU) as engine:
        assert engine.pipeline.runners[0].model.attn_kernel == "triton"
        yield engine


@pytest.fixture(scope="module")
def minilm_alone(minilm_budget256) -> np.ndarray:
    alone, in_batch = _alone_and_in_batch(minilm_budget256, TARGETS, OTHERS, seed=3)
    _assert_bit_equal(alone, in_batch, "MiniLM bf16 alone vs in a shuffled batch, budget 256")
    return alone


def test_minilm_alone_equals_in_a_shuffled_batch(minilm_alone):
    assert minilm_alone.shape == (len(TARGETS), 384)


@pytest.mark.parametrize(
    "options",
    [
        {"max_num_batched_tokens": 16384},
        {"max_num_batched_tokens": 16384, "cuda_graphs": False},
        {"max_num_batched_tokens": 256, "cuda_graphs": False},
        {"max_num_batched_tokens": 16384, **_dp2()},
    ],
    ids=["budget16384", "budget16384-eager", "budget256-eager", "dp2"],
)
def test_minilm_equal_across_budgets_graphs_and_replicas(minilm_path, minilm_alone, options):
    with pipepool.Engine(str(minilm_path), **options, **GPU) as engine:
        _, in_batch = _alone_and_in_batch(engine, TARGETS, OTHERS, seed=4)
    _assert_bit_equal(minilm_alone, in_batch, f"budget 256 alone vs {options}")


def test_minilm_invariant_vectors_stay_within_bf16_of_the_default(minilm_path, minilm_alone):
    with pipepool.Engine(str(minilm_path), device="cuda", dtype="bfloat16") as engine:
        default = engine.embed(TARGETS)
    assert float(tiny_models.cosine(minilm_alone, default).min()) >= 0.999


@pytest.fixture(scope="module")
def qwen3_head32(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-head32") / "qwen3"
    return tiny_models.make_decoder(path, "qwen3", num_attention_heads=2, head_dim=32)


def test_decoder_equal_across_chunking_graphs_and_replicas(qwen3_head32):
    targets, others = TARGETS[:6], OTHERS[:24]
    seen: dict[str, list[np.ndarray]] = {"last": [], "mean": []}
    for options in (
        {"max_num_batched_tokens": 16},
        {"max_num_batched_tokens": 16384},
        {"max_num_batched_tokens": 16, "cuda_graphs": False},
        {"max_num_batched_tokens": 256, **_dp2()},
    ):
        with pipepool.Engine(str(qwen3_head32), **options, **GPU) as engine:
            for pooling, runs in seen.items():
                alone, in_batch = _alone_and_in_batch(
                    engine, targets, others, seed=5, pooling=pooling, normalize=True
                )
                _assert_bit_equal(alone, in_batch, f"qwen3 {pooling} {options}")
                runs.append(alone)
    for pooling, runs in seen.items():
        for other in runs[1:]:
            _assert_bit_equal(runs[0], other, f"qwen3 {pooling} across budgets, graphs, DP")


def test_kernels_give_each_row_the_same_bits_whatever_m():
    from pipepool.layers import invariant_triton

    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        w = torch.randn(1536, 384, device="cuda").to(dtype)
        bias = torch.randn(1536, device="cuda").to(dtype)
        x = torch.randn(3000, 384, device="cuda").to(dtype)
        full = invariant_triton.matmul(x, w.t(), bias)
        for m in (1, 2, 7, 64, 129, 1000):
            assert torch.equal(invariant_triton.matmul(x[5 : 5 + m], w.t(), bias), full[5 : 5 + m])
        sums = invariant_triton.row_sums(x, square=True)
        for m in (1, 3, 100):
            assert torch.equal(
                invariant_triton.row_sums(x[9 : 9 + m], square=True), sums[9 : 9 + m]
            )
        residual = torch.randn(3000, 384, device="cuda").to(dtype)
        norm = tuple(torch.randn(384, device="cuda").to(dtype) for _ in range(2))
        y, y_bias = full[:, :384], bias[:384]
        normed = invariant_triton.add_layer_norm(y, y_bias, residual, *norm, 1e-12)
        eager = torch.nn.functional.layer_norm(residual + (y + y_bias), (384,), *norm, 1e-12)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(normed.float(), eager.float(), rtol=tol, atol=tol)
        for m in (1, 3, 100):
            rows = slice(9, 9 + m)
            part = invariant_triton.add_layer_norm(y[rows], y_bias, residual[rows], *norm, 1e-12)
            assert torch.equal(part, normed[rows])


def test_the_products_give_each_row_the_same_bits_whatever_m():
    """invariant_matmul in bf16 (cuBLAS tiles where their check passes, else Triton): a row's
    bits alone, at the head of few rows and inside steps over several launches."""
    from pipepool.layers import invariant_ops, invariant_tiles

    torch.manual_seed(0)
    for k, n in ((384, 1536), (1024, 6144), (3072, 1024)):
        w = torch.randn(n, k, device="cuda").to(torch.bfloat16)
        bias = torch.randn(n, device="cuda").to(torch.bfloat16)
        x = torch.randn(40_000, k, device="cuda").to(torch.bfloat16)
        full = invariant_ops.invariant_linear(x, w, bias)
        torch.testing.assert_close(full.float(), x.float() @ w.float().t() + bias.float(),
                                   rtol=2e-2, atol=2e-1)  # fmt: skip
        for m in (1, 2, 255, 257, 1000, 16_385, 39_990):
            part = invariant_ops.invariant_linear(x[5 : 5 + m], w, bias)
            assert torch.equal(part, full[5 : 5 + m]), (k, n, m)
        print(f"({k}, {n}): cuBLAS tiles "
              f"{invariant_tiles.cuda_tiles_agree(k, n, torch.bfloat16, x.device)}")  # fmt: skip


def test_the_bias_pass_gives_the_eager_additions_bits():
    """``gated_activation.add_bias_`` / ``bias_gelu_tanh_`` compiled: the bits of ``y + bias``
    (and near torch's tanh GELU of it) at MiniLM's widths, and on rows of a wider tensor."""
    from pipepool.layers.gated_activation import add_bias_, agrees, bias_gelu_tanh_

    torch.manual_seed(0)
    for width in (384, 1152, 1536, 1100):
        y = torch.randn(3001, width, device="cuda").to(torch.bfloat16)
        bias = torch.randn(width, device="cuda").to(torch.bfloat16)
        assert torch.equal(add_bias_(y.clone(), bias), y + bias), width
        eager = torch.nn.functional.gelu(y + bias, approximate="tanh")
        assert agrees(eager, bias_gelu_tanh_(y.clone(), bias)), width
        wide = torch.randn(3001, width + 64, device="cuda").to(torch.bfloat16)
        rows = wide[:, :width]  # rows of contiguous columns, further apart than their width
        want = rows + bias
        assert torch.equal(add_bias_(rows, bias), want) and torch.equal(wide[:, :width], want)
