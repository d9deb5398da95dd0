"""The CPU-only paths: length-sorted request tiles (encoders), row tiles (decoder MLPs), and
oneDNN's packed and fused linear ops (fp32, and bf16 where the CPU has it), each against the
plain computation or transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_models import MIN_COSINE, cosine, long_prompts

import pipepool
from pipepool.layers import cpu_linear, cpu_tiles
from pipepool.models import bert, decoder


def test_plan_tiles_sorts_longest_first_and_covers_every_row():
    lens = np.array([5, 1, 9, 9, 3, 30, 2, 9, 4])
    cu = np.concatenate(([0], np.cumsum(lens)))
    tiles = cpu_tiles.plan_tiles(cu, tile_tokens=12)
    rows = torch.cat([t.rows for t in tiles]).numpy()
    assert sorted(rows) == list(range(cu[-1]))  # every row once
    tile_lens = np.concatenate([np.diff(t.meta.cu_q_host) for t in tiles])
    assert list(tile_lens) == sorted(lens, reverse=True)
    assert all(int(t.meta.cu_q_host[-1]) < 12 + max(lens) for t in tiles)
    for t in tiles:  # each request's rows stay contiguous and in order
        for a, b in zip(t.meta.cu_q_host[:-1], t.meta.cu_q_host[1:], strict=True):
            assert np.all(np.diff(t.rows.numpy()[a:b]) == 1)


def test_a_tile_takes_the_requests_starting_in_its_span():
    # Six requests of 5 tokens start at 0, 5, ..., 25; 30 tokens make 3 spans of 10.
    cu = np.arange(0, 35, 5)
    tiles = cpu_tiles.plan_tiles(cu, tile_tokens=12)
    assert [int(t.meta.cu_q_host[-1]) for t in tiles] == [10, 10, 10]


def test_in_row_tiles_equals_whole_computation():
    x, y = torch.randn(1000, 8), torch.randn(1000, 3, 4)
    fn = lambda a, b: a * 2 + b.flatten(1).sum(1, keepdim=True)  # noqa: E731
    torch.testing.assert_close(cpu_tiles.in_row_tiles(fn, x, y, rows=128), fn(x, y))
    torch.testing.assert_close(cpu_tiles.in_row_tiles(fn, x[:5], y[:5], rows=128), fn(x[:5], y[:5]))


@pytest.mark.skipif(not cpu_linear.supported(), reason="oneDNN fused linear ops not available")
@pytest.mark.parametrize("activation", ["identity", "relu", "gelu", "gelu_new"])
def test_fused_linear_matches_eager(activation):
    from pipepool.layers.activation import ACTIVATIONS

    x, w, b, res = torch.randn(300, 64), torch.randn(96, 64), torch.randn(96), torch.randn(300, 96)
    packed = cpu_linear.pack(w)
    with torch.inference_mode():
        got = cpu_linear.linear(x, packed, b, activation)
        added = cpu_linear.linear_add(x, res, packed, b)
    torch.testing.assert_close(got, ACTIVATIONS[activation](F.linear(x, w, b)))
    torch.testing.assert_close(added, F.linear(x, w, b) + res)


@pytest.mark.skipif(not cpu_linear.packs(torch.bfloat16), reason="no native bf16 oneDNN here")
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_new"])
def test_bf16_linear_rounds_before_activation_and_residual_as_eager_ops(activation):
    """In bf16 the product is rounded before the activation and the residual add, as an eager
    model (transformers) rounds it: bit for bit the eager ops' result, where the fused
    epilogue (on the fp32 accumulator) differed by an ulp on some elements."""
    from pipepool.layers.activation import ACTIVATIONS

    gen = torch.Generator().manual_seed(0)
    x, w, b, res = (
        torch.randn(*shape, generator=gen).bfloat16()
        for shape in ((300, 64), (96, 64), (96,), (300, 96))
    )
    packed = cpu_linear.pack(w)
    with torch.inference_mode():
        got = cpu_linear.linear(x, packed, b, activation)
        added = cpu_linear.linear_add(x, res, packed, b)
    assert torch.equal(got, ACTIVATIONS[activation](F.linear(x, w, b)))
    assert torch.equal(added, res + F.linear(x, w, b))


@pytest.mark.parametrize("fused", [True, False])
def test_encoder_in_many_tiles_matches_transformers(bert_path, reference, monkeypatch, fused):
    # Tiles of ~40 tokens: the step splits into many tiles; repeated prompts make runs of equal
    # lengths. Per-token pooling ("all") would catch a row landing in the wrong place.
    monkeypatch.setattr(cpu_tiles, "CPU_TILE_TOKENS", 40)
    if not fused:
        monkeypatch.setattr(cpu_linear, "packs", lambda dtype: False)
    ref = reference(bert_path)
    prompts = long_prompts()
    prompts = prompts + prompts[::-1] + prompts[:3]
    with pipepool.Engine(str(bert_path), max_num_batched_tokens=4096) as engine:
        for pooling in ("all", "mean", "cls"):
            outs = engine.pool(prompts, pooling=pooling, normalize=False)
            for text, out in zip(prompts, outs, strict=True):
                expected = ref.pooled(ref.token_ids(text), pooling)
                assert cosine(out, expected).min() >= MIN_COSINE


@pytest.mark.parametrize("packed", [True, False])
def test_decoder_mlp_row_tiles_match_transformers(qwen3_path, reference, monkeypatch, packed):
    monkeypatch.setattr(cpu_tiles, "CPU_MLP_TILE_ROWS", 16)
    if not packed:
        monkeypatch.setattr(cpu_linear, "packs", lambda dtype: False)
    elif not cpu_linear.packs(torch.float32):
        pytest.skip("oneDNN packed linear ops not available")
    calls = _count_calls(monkeypatch, decoder.DecoderLayer, "forward_packed")
    ref = reference(qwen3_path)
    prompts = long_prompts()
    with pipepool.Engine(str(qwen3_path), max_num_batched_tokens=256) as engine:
        outs = engine.pool(prompts, pooling="all", normalize=False)
    assert (calls[0] > 0) == packed  # the path meant ran
    for text, out in zip(prompts, outs, strict=True):
        assert cosine(out, ref.pooled(ref.token_ids(text), "all")).min() >= MIN_COSINE


@pytest.mark.skipif(not cpu_linear.packs(torch.bfloat16), reason="no native bf16 oneDNN here")
@pytest.mark.parametrize("family", ["bert", "qwen3"])
def test_bf16_packed_errs_no_more_than_transformers_bf16(
    family, bert_path, qwen3_path, reference, monkeypatch
):
    """bf16 on a CPU that computes it natively: the packed oneDNN GEMMs run, and each
    request's mean vector errs against the fp32 reference no more than transformers' own bf16
    does on the CPU (docs/design.md §3: 1 - cos within 1.5x transformers' + 1e-5), with prompts
    chunked on the decoder (budget 64)."""
    import transformers

    path = bert_path if family == "bert" else qwen3_path
    if family == "bert":
        calls = _count_calls(monkeypatch, bert.EncoderLayer, "forward_fused")
    else:
        calls = _count_calls(monkeypatch, decoder.DecoderLayer, "forward_packed")
    ref = reference(path)
    theirs = transformers.AutoModel.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    prompts = long_prompts()
    with pipepool.Engine(
        str(path), device="cpu", dtype="bfloat16", max_num_batched_tokens=64
    ) as engine:
        outs = engine.pool(prompts, pooling="mean", normalize=False)
    assert calls[0] > 0
    for text, out in zip(prompts, outs, strict=True):
        ids = ref.token_ids(text)
        want = ref.pooled(ids, "mean")
        with torch.no_grad():
            h = theirs(input_ids=torch.tensor([ids])).last_hidden_state[0]
        bar = 1.5 * (1 - cosine(h.float().mean(0).numpy(), want)) + 1e-5
        assert 1 - cosine(out, want) <= bar, len(ids)


def _count_calls(monkeypatch, cls, name: str) -> list[int]:
    """Count the calls of ``cls.name`` (the engine's stage runs in this process at PP=1)."""
    calls = [0]
    original = getattr(cls, name)

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, counted)
    return calls


@pytest.mark.parametrize("native", [False, True], ids=["emulated", "native"])
def test_half_precision_on_a_cpu_that_emulates_it_is_warned_about(bert_path, monkeypatch, native):
    import warnings

    monkeypatch.setattr(cpu_linear, "native_half", lambda dtype: native)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pipepool.Engine(str(bert_path), dtype="bfloat16") as engine:
            assert engine.embed(["still computed"]).shape[0] == 1
    emulated = [w for w in seen if "emulated" in str(w.message)]
    if native:
        assert emulated == []
    else:
        assert len(emulated) == 1 and issubclass(emulated[0].category, RuntimeWarning)
        assert "dtype bfloat16 on a CPU without native bfloat16" in str(emulated[0].message)
