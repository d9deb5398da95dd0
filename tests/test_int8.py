"""dtype int8: the CPU encoder's linear layers as dynamic int8 GEMMs (layers/int8_linear.py),
judged against the float32 engine by a fixed cosine floor, and refused where it cannot run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_models import SENTENCES, cosine, long_prompts

import pipepool
from pipepool.config import EngineConfig
from pipepool.errors import InvalidInputError
from pipepool.layers import int8_linear
from pipepool.loading import deployment as deployment_module
from pipepool.loading.deployment import plan_deployment
from pipepool.parity import MIN_COSINE_INT8, Sweep, run_parity

pytestmark = pytest.mark.skipif(not int8_linear.supported(), reason="no int8 kernel here")

# all-MiniLM-L6-v2 on 59 real texts, int8 against float32 (2 AMD EPYC cores, torch 2.13),
# each token's activations on its own scale: min 0.9918, mean 0.9972 (one scale per tile
# measured 0.9855 / 0.9933). The bars leave a margin below what was measured.
MINILM_MIN_COSINE, MINILM_MEAN_COSINE = 0.99, 0.995
TEXTS = SENTENCES[:50] + long_prompts()


def _embed(path, texts, **options) -> np.ndarray:
    with pipepool.Engine(str(path), **options) as engine:
        return np.stack(engine.embed(texts, normalize=False))


def test_int8_linear_agrees_with_fp32_within_int8_rounding():
    gen = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(200, 96, generator=gen), torch.randn(64, 96, generator=gen), None
    want = F.linear(x, w, b)
    with torch.inference_mode():
        got = int8_linear.linear(x, int8_linear.pack(w, b))
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert cosine(got.numpy(), want.numpy()).min() > 0.999  # 8-bit rounding of both operands
    assert (got - want).abs().max() < 0.03 * want.abs().max()


def test_a_rows_int8_result_does_not_depend_on_the_rows_beside_it():
    """Each row is quantized on its own range: alone, among others, or beside rows 50x
    larger (which set a shared tile scale before), its output is the same, bit for bit."""
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(300, 96, generator=gen), torch.randn(64, 96, generator=gen)
    weight = int8_linear.pack(w, torch.randn(64, generator=gen))
    loud = torch.cat([x, 50 * torch.randn(20, 96, generator=gen)])
    with torch.inference_mode():
        together = int8_linear.linear(x, weight)
        alone = torch.cat([int8_linear.linear(x[i : i + 1], weight) for i in range(0, 300, 7)])
        beside_loud = int8_linear.linear(loud, weight)[:300]
    assert torch.equal(alone, together[::7])
    assert torch.equal(beside_loud, together)
    assert not torch.equal(together, F.linear(x, w, weight.bias))  # int8 really ran


@pytest.fixture(scope="module")
def minilm_vectors(minilm_path) -> dict[str, np.ndarray]:
    """float32, int8 and int8 with two stages on the same texts."""
    return {
        "fp32": _embed(minilm_path, TEXTS),
        "int8": _embed(minilm_path, TEXTS, dtype="int8"),
        "int8 pp2": _embed(minilm_path, TEXTS, dtype="int8", pipeline_parallel_size=2),
    }


@pytest.mark.parametrize("kind", ["int8", "int8 pp2"])
def test_minilm_int8_stays_close_to_fp32_on_real_texts(minilm_vectors, kind):
    cos = cosine(minilm_vectors[kind], minilm_vectors["fp32"])
    assert cos.min() >= MINILM_MIN_COSINE, cos.min()
    assert cos.mean() >= MINILM_MEAN_COSINE, cos.mean()
    assert cos.min() < 0.9999  # int8 really ran: float32 would agree to rounding


def test_minilm_int8_pp2_equals_pp1(minilm_vectors):
    # Each token's activations are quantized on their own scale, on whichever stage.
    assert cosine(minilm_vectors["int8 pp2"], minilm_vectors["int8"]).min() >= 0.99999


def test_tiny_bert_int8_stays_close_to_fp32(bert_path):
    want = _embed(bert_path, TEXTS[:20])
    got = _embed(bert_path, TEXTS[:20], dtype="int8")
    cos = cosine(got, want)  # measured: min 0.99962, mean 0.99980
    assert cos.min() >= 0.999, cos.min()
    assert cos.mean() >= 0.9995, cos.mean()


def test_int8_refused_on_cuda(bert_path, monkeypatch):
    monkeypatch.setattr(deployment_module, "resolve_device_kind", lambda device: "cuda")
    with pytest.raises(InvalidInputError, match="int8 runs on the CPU only") as err:
        plan_deployment(EngineConfig(model=str(bert_path), dtype="int8", device="cuda"))
    assert err.value.param == "dtype"


def test_int8_refused_for_a_family_without_the_path(tmp_path):
    from tiny_encoders import make_mpnet

    path = make_mpnet(tmp_path / "mpnet")
    with pytest.raises(InvalidInputError, match="not available for the mpnet family"):
        plan_deployment(EngineConfig(model=str(path), dtype="int8"))


def test_int8_refused_where_the_kernel_fails_its_check(bert_path, monkeypatch):
    monkeypatch.setattr(int8_linear, "supported", lambda: False)
    with pytest.raises(InvalidInputError, match="int8 is not supported on this machine"):
        plan_deployment(EngineConfig(model=str(bert_path), dtype="int8"))


def test_int8_deployment_keeps_float32_for_everything_else(bert_path):
    d = plan_deployment(EngineConfig(model=str(bert_path), dtype="int8"))
    assert d.int8_linears and d.dtype == torch.float32
    assert d.stage_spec(0).int8_linears
    assert not plan_deployment(EngineConfig(model=str(bert_path))).int8_linears


def test_parity_judges_int8_by_its_floor_against_float32(bert_path):
    sweep = Sweep(pps=(1,), budgets=(64,), poolings=("mean",), reference="pp1")
    report = run_parity(EngineConfig(model=str(bert_path), dtype="int8"), sweep, log=lambda _: None)
    assert report.min_cosine == MIN_COSINE_INT8
    assert "int8" in report.engine and "float32" in report.reference
    assert "fixed floor" in (report.rule or "") and "not by docs/design.md" in (report.rule or "")
    assert report.passed, report.summary()
