"""ModernBERT (models/modernbert.py) against transformers and sentence-transformers on the same
weights, fp32 on the CPU, at PP 1 and 2: global and local (symmetric sliding-window) layers,
every pooler, a sentence-transformers folder and a sequence classifier's scores; the config
fields it does not compute are refused by name."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import (
    MIN_COSINE,
    Reference,
    assert_triton_graphs_bf16,
    cosine,
    long_prompts,
)
from tiny_modernbert import (
    TINY_MODERNBERT,
    make_modernbert,
    make_modernbert_classifier,
    make_modernbert_masked_lm,
    make_st_modernbert,
)

import pipepool
from pipepool.errors import ModelLoadError
from pipepool.layers.attention import AttentionMetadata
from pipepool.layers.windowed_attention import windowed_attention

HALF_WINDOW = TINY_MODERNBERT["local_attention"] // 2
TOLERANCE = 1e-4  # classifier logits, fp32
QUERY = "What does a pipeline stage keep for each request it serves?"


@pytest.fixture(scope="module")
def modernbert_path(model_dir) -> Path:
    # gte-modernbert-base's config says classifier_pooling "mean", which an embedding model
    # never reads: it must load.
    return make_modernbert(model_dir / "modernbert", classifier_pooling="mean")


@pytest.fixture(scope="module")
def classifier_path(model_dir) -> Path:
    # The config as transformers 5.17 writes it (layer_types, rope_parameters).
    return make_modernbert_classifier(model_dir / "modernbert-reranker")


def _assert_matches(engine, ref: Reference, prompts: list[str], pooling: str) -> None:
    outs = engine.pool(prompts, pooling=pooling, normalize=False)
    for text, out in zip(prompts, outs, strict=True):
        ids = ref.token_ids(text)
        assert [int(t) for t in engine.tokenize([text])[0]] == ids
        worst = float(cosine(out, ref.pooled(ids, pooling)).min())  # per token for "all"
        assert worst >= MIN_COSINE, f"{pooling}, {len(ids)} tokens: cosine {worst}"


@pytest.mark.parametrize("pp", [1, 2])
def test_modernbert_matches_transformers_every_pooler(modernbert_path, reference, pp):
    ref = reference(modernbert_path)
    prompts = long_prompts()
    assert max(len(ref.token_ids(p)) for p in prompts) > 150 > 2 * HALF_WINDOW
    with pipepool.Engine(
        str(modernbert_path), pipeline_parallel_size=pp, max_num_batched_tokens=16
    ) as engine:
        for pooling in ("cls", "mean", "all"):
            _assert_matches(engine, ref, prompts, pooling)


def test_the_window_cuts_the_long_prompts(modernbert_path, reference):
    """Without its window the same weights give other vectors, so the parity above needs the
    local layer's window (and which layers are local) to be right."""
    import transformers

    ref = reference(modernbert_path)
    ids = torch.tensor([ref.token_ids(long_prompts()[3])])
    unwindowed = transformers.AutoModel.from_pretrained(
        str(modernbert_path), local_attention=4096
    ).eval()
    with torch.no_grad():
        windowed = ref.model(input_ids=ids).last_hidden_state[0].numpy()
        whole = unwindowed(input_ids=ids).last_hidden_state[0].numpy()
    assert float(cosine(windowed, whole).min()) < 0.999


def test_masked_lm_checkpoint_runs_its_encoder(model_dir, reference):
    """ModernBertForMaskedLM: the encoder under ``model.``; its MLM head and decoder are not
    part of the embedding model."""
    path = make_modernbert_masked_lm(model_dir / "modernbert-mlm")
    ref = reference(path)  # AutoModel: the encoder of the MLM checkpoint
    with pipepool.Engine(str(path), max_num_batched_tokens=64) as engine:
        _assert_matches(engine, ref, long_prompts()[:4], "mean")


def test_sentence_transformers_folder_matches_encode(model_dir):
    from sentence_transformers import SentenceTransformer

    path = make_st_modernbert(model_dir / "st-modernbert")
    texts = long_prompts()
    expected = SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_numpy=True)
    with pipepool.Engine(str(path), max_num_batched_tokens=16) as engine:
        assert engine.info.pooling == "mean" and engine.info.normalize
        got = engine.embed(texts)
    assert got.shape == expected.shape == (len(texts), 64)
    assert cosine(got, expected).min() >= MIN_COSINE


@pytest.mark.parametrize("pp", [1, 2])
def test_classifier_scores_match_transformers_logits(classifier_path, pp):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(classifier_path))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(classifier_path), dtype=torch.float32
    ).eval()
    documents = long_prompts()
    expected = []
    with torch.no_grad():  # ModernBERT takes no token types
        for doc in documents:
            ids = tokenizer([QUERY], [doc], return_tensors="pt")["input_ids"]
            expected.append(model(input_ids=ids).logits[0, 0].item())
    assert max(expected) - min(expected) > 100 * TOLERANCE  # the scores tell documents apart
    with pipepool.Engine(
        str(classifier_path), pipeline_parallel_size=pp, max_num_batched_tokens=16
    ) as engine:
        got = engine.score(QUERY, documents, use_activation=False)
    assert np.abs(got - np.array(expected)).max() <= TOLERANCE


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("pp", [1, 2])
def test_a_classifier_on_the_mean_row_matches_transformers(classifier_path, tmp_path, pp):
    """gte-reranker-modernbert-base's config: classifier_pooling "mean" (the head reads the
    mean of the final hidden states, not the [CLS] row)."""
    import transformers

    path = _edit_config(classifier_path, tmp_path / "mean", classifier_pooling="mean")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(path), dtype=torch.float32
    ).eval()
    documents = long_prompts()
    with torch.no_grad():
        expected = [
            model(input_ids=tokenizer([QUERY], [d], return_tensors="pt")["input_ids"])
            .logits[0, 0]
            .item()
            for d in documents
        ]
    with pipepool.Engine(str(path), pipeline_parallel_size=pp, max_num_batched_tokens=16) as e:
        assert e.info.pooling == "mean"
        got = e.score(QUERY, documents, use_activation=False)
    assert np.abs(got - np.array(expected)).max() <= TOLERANCE


def test_an_unknown_classifier_pooling_is_refused_by_name(classifier_path, tmp_path):
    path = _edit_config(classifier_path, tmp_path / "max", classifier_pooling="max")
    with pytest.raises(ModelLoadError, match="classifier_pooling 'max'"):
        pipepool.Engine(str(path))


@pytest.mark.parametrize(
    "field,value",
    [
        ("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
        ("rope_parameters", {"full_attention": {"rope_type": "dynamic", "factor": 2.0}}),
        ("layer_types", ["full_attention", "chunked_attention", "full_attention"]),
        ("layer_types", ["full_attention", "sliding_attention"]),  # one short
        ("head_dim", 32),
        ("local_rope_theta", None),
        ("hidden_activation", "gelu_fast"),
    ],
)
def test_math_it_does_not_compute_is_refused_by_name(modernbert_path, tmp_path, field, value):
    path = _edit_config(modernbert_path, tmp_path / "edited", **{field: value})
    with pytest.raises(ModelLoadError, match=field):
        pipepool.Engine(str(path))


def _reference_window(q, k, v, cu, scale, half_window):
    """Per request, explicit scores in float64 with the |i - j| <= half_window mask."""
    out = []
    for a, b in itertools.pairwise(cu.tolist()):
        qi, ki, vi = (x[a:b].double().transpose(0, 1) for x in (q, k, v))  # [H, L, D]
        scores = qi @ ki.transpose(1, 2) * scale
        pos = torch.arange(b - a)
        scores[:, (pos[:, None] - pos[None, :]).abs() > half_window] = float("-inf")
        out.append((scores.softmax(-1) @ vi).transpose(0, 1))
    return torch.cat(out).float()


@pytest.mark.parametrize("half_window", [0, 3, 8])
def test_windowed_attention_matches_the_masked_reference(half_window):
    """Lengths around each path's bounds (no mask, one band mask, blocks), runs of equal
    lengths, and a V that is a strided view of a fused projection."""
    lengths = [1, 2, half_window + 1, half_window + 2, 30, 30, 64, 65, 97, 200, 200, 5]
    cu = np.concatenate(([0], np.cumsum(lengths)))
    gen = torch.Generator().manual_seed(0)
    total, heads, dim = int(cu[-1]), 4, 16
    q = torch.randn(total, heads, dim, generator=gen)
    k = torch.randn(total, heads, dim, generator=gen)
    v = torch.randn(total, 3, heads, dim, generator=gen).unbind(1)[2]
    meta = AttentionMetadata(
        causal=False,
        cu_seqlens_q=torch.from_numpy(cu.astype(np.int32)),
        cu_seqlens_k=torch.from_numpy(cu.astype(np.int32)),
        max_q=max(lengths),
        max_k=max(lengths),
        cu_q_host=cu,
        cu_k_host=cu,
        total_k=total,
    )
    got = windowed_attention(q, k, v, meta, scale=0.25, half_window=half_window)
    want = _reference_window(q, k, v, cu, 0.25, half_window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_local_layers_run_in_the_triton_kernel_inside_cuda_graphs(tmp_path, reference):
    """32-dim heads, bf16: both kinds of layer run in the Triton kernel (the local ones with
    its symmetric window), inside whole-step CUDA graphs, no less accurate than transformers'
    bf16."""
    path = make_modernbert(tmp_path / "modernbert32", num_attention_heads=2)
    assert_triton_graphs_bf16(path, reference(path), long_prompts())
