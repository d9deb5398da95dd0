"""DeBERTa-v2 (models/deberta.py, layers/disentangled_attention.py) against transformers on the
same tiny weights, fp32 on the CPU, at PP=1 and PP=2 (stage processes over gloo) with a token
budget below the longest prompt: every pooler per request (per token for "all"), the token ids,
the classifier's logits on texts and pairs, the relative-position rows against transformers'
own, and the refusal of what is not implemented."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_deberta import V2_EMBEDDER, V3_CLASSIFIER, make_deberta
from tiny_models import MIN_COSINE, SENTENCES, cosine, long_prompts

import pipepool
from pipepool.errors import ModelLoadError
from pipepool.layers.attention import AttentionMetadata
from pipepool.layers.disentangled_attention import (
    PositionTerms,
    RelativeIndex,
    disentangled_attention,
    relative_index_tables,
)
from pipepool.models.checkpoint_math import check_config
from pipepool.models.deberta import DebertaConfig

POOLINGS = ("cls", "mean", "all")
BUDGET = 16  # tokens per step: the longest prompt is far longer
TOLERANCE = 1e-4  # classifier logits, fp32
QUERY = "What does a pipeline stage keep for each request it serves?"
DOCUMENTS = [*long_prompts(), *SENTENCES[4:8]]


def _engine(path: Path, pp: int) -> pipepool.Engine:
    return pipepool.Engine(
        str(path), pipeline_parallel_size=pp, max_num_batched_tokens=BUDGET, device="cpu"
    )


@pytest.fixture(scope="module")
def embedder(tmp_path_factory) -> Path:
    """deberta-v2's switches: absolute positions too, own position projections, embed_proj."""
    return make_deberta(tmp_path_factory.mktemp("deberta") / "embedder", **V2_EMBEDDER)


@pytest.mark.parametrize("pp", [1, 2])
def test_embedder_poolings_match_transformers(embedder, reference, pp):
    ref = reference(embedder)
    prompts = long_prompts()
    assert max(len(ref.token_ids(p)) for p in prompts) > 150 > BUDGET
    with _engine(embedder, pp) as engine:
        ids = engine.tokenize(prompts)
        outs = {p: engine.pool(prompts, pooling=p, normalize=False) for p in POOLINGS}
    for text, got in zip(prompts, ids, strict=True):
        assert got.tolist() == ref.token_ids(text)
    for pooling, pooled in outs.items():
        worst = 1.0
        for text, out in zip(prompts, pooled, strict=True):
            expected = ref.pooled(ref.token_ids(text), pooling)
            assert out.shape == expected.shape
            worst = min(worst, float(cosine(out, expected).min()))  # per token for "all"
        assert worst >= MIN_COSINE, f"PP={pp} {pooling}: worst cosine {worst}"


def test_relative_embeddings_change_transformers_output(embedder):
    """The parity above depends on the disentangled terms: with the relative embeddings
    zeroed, transformers' own output moves a hundred times further than the parity bar
    allows, so a term computed wrongly (or not at all) would fail it."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(embedder))
    model = transformers.AutoModel.from_pretrained(str(embedder), dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer(long_prompts()[3])["input_ids"]])
    with torch.no_grad():
        full = model(input_ids=ids).last_hidden_state[0].numpy()
        model.encoder.rel_embeddings.weight.zero_()
        without = model(input_ids=ids).last_hidden_state[0].numpy()
    assert 1 - cosine(full, without).min() > 100 * (1 - MIN_COSINE)


@pytest.mark.parametrize("buckets,max_relative", [(8, 64), (256, 512), (-1, 48)])
def test_relative_rows_match_transformers(buckets, max_relative):
    """The table rows each (query, key) reads, against the indices transformers gathers: its
    bucketed relative positions, shifted and clamped for c2p, and for p2c the transposed
    gather of the negated ones."""
    from transformers.models.deberta_v2.modeling_deberta_v2 import build_relative_position

    length, max_len = 300, 512
    span = buckets if buckets > 0 else max_relative
    c2p_rows, p2c_rows = relative_index_tables(max_len, span, buckets, max_relative)
    x = torch.zeros(1, length, 1)
    rel = build_relative_position(x, x, bucket_size=buckets, max_position=max_relative)[0]
    pos = torch.arange(length)
    distance = pos[:, None] - pos[None, :] + max_len - 1  # [q, k]
    assert torch.equal(c2p_rows[distance], torch.clamp(rel + span, 0, 2 * span - 1))
    assert torch.equal(p2c_rows[distance], torch.clamp(-rel + span, 0, 2 * span - 1).t())


def test_packed_runs_match_one_request_at_a_time():
    """An unsorted packed step (runs of equal lengths, as a GPU step comes) attends as each
    request alone does, computed as transformers writes it: (q kᵀ + c2p + p2c) / sqrt(3 D)."""
    torch.manual_seed(0)
    lengths, heads, dim, span, max_len = [5, 7, 7, 5, 3, 3, 3], 2, 8, 4, 16
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, dim, dtype=torch.float64) for _ in range(3))
    pos_key, pos_query = (torch.randn(heads, 2 * span, dim, dtype=torch.float64) for _ in "kq")
    index = RelativeIndex(*relative_index_tables(max_len, span, span, 8))
    cu = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    meta = AttentionMetadata(
        False, torch.from_numpy(cu), torch.from_numpy(cu), max(lengths), max(lengths), cu, cu
    )
    got = disentangled_attention(
        q, k, v, meta, PositionTerms(pos_key, pos_query, index), scale_factor=3
    )
    for start, n in zip(cu[:-1].tolist(), lengths, strict=True):
        qr, kr, vr = (x[start : start + n].transpose(0, 1) for x in (q, k, v))  # [H, L, D]
        c2p_idx, p2c_idx = index(n)
        c2p = torch.gather(qr @ pos_key.transpose(-1, -2), -1, c2p_idx.expand(heads, n, n))
        p2c = torch.gather(kr @ pos_query.transpose(-1, -2), -1, p2c_idx.t().expand(heads, n, n))
        scores = (qr @ kr.transpose(-1, -2) + c2p + p2c.transpose(-1, -2)) / (3 * dim) ** 0.5
        expected = (scores.softmax(-1) @ vr).transpose(0, 1)
        assert torch.allclose(got[start : start + n], expected, atol=1e-12)


# Switches the fixtures above leave out: no relative attention (whose scale still counts the
# terms pos_att_type names), one term alone, no buckets (distances clamped at
# max_relative_positions), and max_relative_positions from max_position_embeddings.
VARIANTS = {
    "no-relative": dict(relative_attention=False, pos_att_type=["c2p"], type_vocab_size=2),
    "c2p-only": dict(pos_att_type="c2p", position_biased_input=False),
    "p2c-shared": dict(pos_att_type=["p2c"], share_att_key=True, norm_rel_ebd="layer_norm"),
    "unbucketed": dict(position_buckets=-1, max_relative_positions=40),
    "default-span": dict(position_buckets=16, max_relative_positions=-1),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_variants_match_transformers(tmp_path, reference, variant):
    path = make_deberta(tmp_path / variant, **VARIANTS[variant])
    ref = reference(path)
    prompts = long_prompts()
    with _engine(path, 1) as engine:
        outs = engine.pool(prompts, pooling="all", normalize=False)
    for text, out in zip(prompts, outs, strict=True):
        assert cosine(out, ref.pooled(ref.token_ids(text), "all")).min() >= MIN_COSINE


def test_masked_lm_checkpoint_embeds_as_its_encoder(tmp_path, reference):
    """DebertaV2ForMaskedLM's LM head is stored but not part of the encoder: skipped by name."""
    path = make_deberta(tmp_path / "mlm", "DebertaV2ForMaskedLM", **V3_CLASSIFIER)
    ref = reference(path)
    prompts = long_prompts()[:4]
    with _engine(path, 1) as engine:
        outs = engine.pool(prompts, pooling="cls", normalize=False)
    for text, out in zip(prompts, outs, strict=True):
        assert cosine(out, ref.pooled(ref.token_ids(text), "cls")) >= MIN_COSINE


@pytest.mark.parametrize(
    "field,value",
    [("conv_kernel_size", 3), ("pos_att_type", ["c2p", "p2p"]), ("norm_rel_ebd", "rms")],
)
def test_unimplemented_config_fields_are_refused_by_name(field, value):
    hf = {"model_type": "deberta-v2", field: value}
    with pytest.raises(ModelLoadError, match=re.escape(f"{field}={value!r}")):
        check_config(hf, family="deberta", decoder=False, architecture="DebertaV2Model")


@pytest.mark.parametrize("field,value", [("attention_head_size", 8), ("pooler_hidden_size", 32)])
def test_shapes_other_than_the_hidden_size_are_refused_by_name(field, value):
    hf = {
        "model_type": "deberta-v2", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, field: value,
    }  # fmt: skip
    with pytest.raises(ModelLoadError, match=re.escape(f"{field}={value!r}")):
        DebertaConfig.from_hf(hf)


# -- classifier ---------------------------------------------------------------------------------


class ClassifierReference:
    """transformers' DebertaV2ForSequenceClassification, fp32 CPU, one input at a time, with
    the token types its tokenizer gives (the document of a pair is type 1)."""

    def __init__(self, path: Path) -> None:
        import transformers

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        self.model = transformers.AutoModelForSequenceClassification.from_pretrained(
            str(path), dtype=torch.float32
        ).eval()

    def token_ids(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    @torch.no_grad()
    def logits(self, text: str, pair: str | None = None) -> np.ndarray:
        f = self.tokenizer(text, pair, return_tensors="pt")
        out = self.model(input_ids=f["input_ids"], token_type_ids=f["token_type_ids"])
        return out.logits[0].numpy()


@pytest.fixture(scope="module")
def classifier_path(tmp_path_factory) -> Path:
    """mxbai-rerank-base-v1's switches (one label), with two token types."""
    root = tmp_path_factory.mktemp("deberta-classifier")
    return make_deberta(root / "v3", "DebertaV2ForSequenceClassification", **V3_CLASSIFIER)


@pytest.fixture(scope="module", params=[1, 2], ids=lambda pp: f"pp{pp}")
def classifier(request, classifier_path):
    """(its reference, an engine on it at PP=pp), shared by the tests below."""
    with _engine(classifier_path, request.param) as engine:
        yield ClassifierReference(classifier_path), engine


def test_classifier_texts_match_transformers_logits(classifier):
    ref, engine = classifier
    texts = long_prompts()
    for text, ids in zip(texts, engine.tokenize(texts), strict=True):
        assert ids.tolist() == ref.token_ids(text)
    got = engine.classify(texts, use_activation=False).probs
    expected = np.stack([ref.logits(t) for t in texts])
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= TOLERANCE


def test_classifier_pairs_match_transformers_logits(classifier):
    ref, engine = classifier
    got = engine.score(QUERY, DOCUMENTS, use_activation=False)
    expected = np.array([ref.logits(QUERY, d)[0] for d in DOCUMENTS])
    assert np.abs(got - expected).max() <= TOLERANCE
