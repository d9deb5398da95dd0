"""batch_invariant on the CPU (fp32): a text's vector is the same bits whatever else is in the
batch, the token budget (chunk boundaries), the PP degree and the DP replica; options it
cannot honour are refused by name (issue 60, docs/batch-invariance.md)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from tiny_models import SENTENCES, cosine

import pipepool
from pipepool.commands.common import add_engine_args
from pipepool.errors import InvalidInputError

WORDS = " ".join(SENTENCES).split()


def _texts(count: int, seed: int) -> list[str]:
    """Texts of 1 to ~60 words: most longer than a 16-token budget."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) for _ in range(count)]


TARGETS = _texts(12, seed=1)
OTHERS = _texts(60, seed=2)


def _alone_and_in_batch(engine, targets: list[str], others: list[str], seed: int, **pooling):
    """Each target embedded alone, and all of them inside a shuffled batch of ``others``
    (``pooling``: ``Engine.pool``'s options, else ``embed``)."""

    def vectors(texts: list[str]) -> list[np.ndarray]:
        return engine.pool(texts, **pooling) if pooling else engine.embed(texts)

    alone = np.stack([vectors([t])[0] for t in targets])
    batch = others + targets
    order = list(range(len(batch)))
    random.Random(seed).shuffle(order)
    mixed = vectors([batch[i] for i in order])
    where = {i: n for n, i in enumerate(order)}
    in_batch = np.stack([mixed[where[len(others) + j]] for j in range(len(targets))])
    return alone, in_batch


def _assert_bit_equal(a: np.ndarray, b: np.ndarray, what: str) -> None:
    differ = [i for i in range(len(a)) if not np.array_equal(a[i], b[i])]
    assert not differ, f"{what}: vectors {differ} differ (max {np.abs(a - b).max():.3g})"


@pytest.fixture(scope="module")
def minilm_pp2_budget16(minilm_path):
    with pipepool.Engine(
        str(minilm_path), device="cpu", batch_invariant=True, pipeline_parallel_size=2,
        max_num_batched_tokens=16,
    ) as engine:  # fmt: skip
        yield engine


@pytest.fixture(scope="module")
def minilm_vectors(minilm_pp2_budget16):
    return _alone_and_in_batch(minilm_pp2_budget16, TARGETS, OTHERS, seed=3)


def test_minilm_alone_equals_in_a_shuffled_batch_at_pp2_budget16(minilm_vectors):
    alone, in_batch = minilm_vectors
    _assert_bit_equal(alone, in_batch, "alone vs in a batch of 72, PP 2, budget 16")


def test_minilm_equal_across_budget_pp_and_dp(minilm_path, minilm_vectors):
    alone, _ = minilm_vectors
    for options in (
        {"max_num_batched_tokens": 8192},  # PP 1, whole batch in one step
        {"data_parallel_size": 2, "max_num_batched_tokens": 32},
    ):
        with pipepool.Engine(
            str(minilm_path), device="cpu", batch_invariant=True, **options
        ) as engine:
            _, in_batch = _alone_and_in_batch(engine, TARGETS, OTHERS, seed=4)
        _assert_bit_equal(alone, in_batch, f"PP 2 budget 16 vs {options}")


def test_minilm_invariant_vectors_match_the_default_path(minilm_path, minilm_vectors):
    alone, _ = minilm_vectors
    with pipepool.Engine(str(minilm_path), device="cpu") as engine:
        default = engine.embed(TARGETS)
    assert float(cosine(alone, default).min()) >= 0.99999


def test_decoder_alone_equals_in_batch_across_chunking_and_pp(qwen3_path):
    """A causal model's prompts chunk across steps: a chunk attends the cached prefix, a
    mean sums rows from several steps, and the chunk boundaries move with the batch and the
    budget."""
    targets, others = _texts(6, seed=5), _texts(24, seed=6)
    results: dict[str, list[np.ndarray]] = {"last": [], "mean": []}
    for options in (
        {"pipeline_parallel_size": 2, "max_num_batched_tokens": 16},
        {"max_num_batched_tokens": 8192},
        {"max_num_batched_tokens": 7},
    ):
        with pipepool.Engine(
            str(qwen3_path), device="cpu", batch_invariant=True, **options
        ) as engine:
            for pooling, seen in results.items():
                alone, in_batch = _alone_and_in_batch(
                    engine, targets, others, seed=7, pooling=pooling, normalize=True
                )
                _assert_bit_equal(alone, in_batch, f"qwen3 {pooling} alone vs batch, {options}")
                seen.append(alone)
    for pooling, seen in results.items():
        for other in seen[1:]:
            _assert_bit_equal(seen[0], other, f"qwen3 {pooling} across budgets and PP")


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"dtype": "int8"}, "int8"),
        ({"compile": True}, "compile"),
    ],
)
def test_options_it_cannot_honour_are_refused_by_name(minilm_path, options, named):
    with pytest.raises(InvalidInputError, match=named) as caught:
        pipepool.Engine(str(minilm_path), device="cpu", batch_invariant=True, **options)
    assert caught.value.param == "batch_invariant"


def test_families_without_an_invariant_form_are_refused(tmp_path):
    from tiny_t5 import make_t5

    path = make_t5(tmp_path / "t5")
    with pytest.raises(InvalidInputError, match="not available for the t5 family"):
        pipepool.Engine(str(path), device="cpu", batch_invariant=True)


def test_the_command_line_offers_the_flag():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--batch-invariant"]).batch_invariant is True
    assert parser.parse_args([]).batch_invariant is None


_KERNEL_CHECK = r"""
import torch
import torch.nn.functional as F
from pipepool.layers import invariant_triton
from pipepool.layers.norm import rms_norm

torch.manual_seed(0)
# The interpreter computes fp32 and fp16 (numpy has no bfloat16); the GPU tests run bf16.
for dtype in (torch.float32, torch.float16):
    w = torch.randn(200, 96).to(dtype)
    bias = torch.randn(200).to(dtype)
    x = torch.randn(150, 96).to(dtype)
    full = invariant_triton.matmul(x, w.t(), bias)
    want = x.float() @ w.float().t() + bias.float()
    tol = 2e-2 if dtype == torch.float16 else 1e-4
    assert torch.allclose(full.float(), want, rtol=1e-2, atol=tol)
    for m in (1, 3, 17, 129):
        for first in (0, 5):
            rows = invariant_triton.matmul(x[first : first + m], w.t(), bias)
            assert torch.equal(rows, full[first : first + m]), (dtype, m, first)
    sums = invariant_triton.row_sums(x, square=True)
    assert torch.allclose(sums, (x.float() ** 2).sum(1), rtol=1e-5)
    for m in (1, 7):
        assert torch.equal(invariant_triton.row_sums(x[3 : 3 + m], square=True), sums[3 : 3 + m])
    for width in (96, 200):  # a power of two and not
        h = torch.randn(50, width).to(dtype)
        weight = (1 + torch.randn(width) / 10).to(dtype)
        normed = invariant_triton.rms_norm(h, weight, 1e-6)
        assert normed.dtype == dtype and normed.shape == h.shape
        tol = 2e-3 if dtype == torch.float16 else 1e-5
        assert torch.allclose(normed.float(), rms_norm(h, weight, 1e-6).float(), rtol=tol,
                              atol=tol)
        for m in (1, 9):
            assert torch.equal(invariant_triton.rms_norm(h[4 : 4 + m], weight, 1e-6),
                               normed[4 : 4 + m])
        residual, norm_bias = torch.randn(50, width).to(dtype), torch.randn(width).to(dtype)
        y_bias = torch.randn(width).to(dtype)
        args = (weight, norm_bias, 1e-12)
        fused = invariant_triton.add_layer_norm(h, y_bias, residual, *args)
        eager = F.layer_norm(residual + (h + y_bias), (width,), *args)
        assert fused.dtype == dtype and fused.shape == h.shape
        assert torch.allclose(fused.float(), eager.float(), rtol=tol, atol=tol)
        for m in (1, 9):
            rows = slice(4, 4 + m)
            alone = invariant_triton.add_layer_norm(h[rows], y_bias, residual[rows], *args)
            assert torch.equal(alone, fused[rows])
print("ok")
"""


def test_cuda_kernels_in_tritons_interpreter():
    """The CUDA path's GEMM, row sums, RMSNorm and LayerNorm with its additions: right, and
    each row's bits independent of M."""
    pytest.importorskip("triton")
    from triton_interpreter import run_interpreted

    run_interpreted(_KERNEL_CHECK)


def test_linear_rows_are_the_same_bits_whatever_m_and_threads():
    """The CPU products behind every layer: MKL's own path changes with M below 12 rows (and
    with the thread count for some M); the tiled form does not."""
    import torch
    import torch.nn.functional as F

    from pipepool.layers.invariant_ops import BatchInvarianceError, batch_invariant

    gen = torch.Generator().manual_seed(0)
    w, bias = torch.randn(1536, 384, generator=gen), torch.randn(1536, generator=gen)
    x = torch.randn(300, 384, generator=gen)
    threads = torch.get_num_threads()
    try:
        with batch_invariant():
            full, product = F.linear(x, w, bias), x @ w.t()
            for n_threads in (1, 2, 3):
                torch.set_num_threads(n_threads)
                for m in (1, 2, 3, 5, 7, 11, 16, 33, 299):
                    assert torch.equal(F.linear(x[1 : 1 + m], w, bias), full[1 : 1 + m]), m
                    assert torch.equal(x[1 : 1 + m] @ w.t(), product[1 : 1 + m]), m
            with pytest.raises(BatchInvarianceError, match="bmm"):
                torch.bmm(x.view(3, 100, 384), w.t().expand(3, 384, 1536))
    finally:
        torch.set_num_threads(threads)
    assert torch.allclose(full, F.linear(x, w, bias), atol=1e-4)
