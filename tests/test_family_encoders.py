"""DistilBERT, ELECTRA and MPNet (models/encoders.py) against transformers and
sentence-transformers on the same tiny weights, fp32 on the CPU, at PP=1 and PP=2 (stage
processes over gloo) with a token budget below the longest prompt: every pooler per request
(per token for "all"), the token ids, MPNet's relative position bias, and the DistilBERT and
ELECTRA classifier heads against transformers' logits."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_encoders import make_distilbert, make_electra, make_mpnet, make_st_mpnet
from tiny_models import (
    MIN_COSINE,
    SENTENCES,
    assert_triton_graphs_bf16,
    cosine,
    long_prompts,
)

import pipepool
from pipepool.errors import ModelLoadError
from pipepool.models.checkpoint_math import check_config

FAMILIES = ("distilbert", "electra", "mpnet")
POOLINGS = ("cls", "mean", "all")
BUDGET = 16  # tokens per step: the longest prompt is far longer
TOLERANCE = 1e-4  # classifier logits, fp32
QUERY = "What does a pipeline stage keep for each request it serves?"
DOCUMENTS = [*long_prompts(), *SENTENCES[4:8]]


def _engine(path: Path, pp: int) -> pipepool.Engine:
    return pipepool.Engine(
        str(path), pipeline_parallel_size=pp, max_num_batched_tokens=BUDGET, device="cpu"
    )


def _worst_cosine(outs, ref, prompts, pooling) -> float:
    worst = 1.0
    for text, out in zip(prompts, outs, strict=True):
        expected = ref.pooled(ref.token_ids(text), pooling)
        assert out.shape == expected.shape
        worst = min(worst, float(cosine(out, expected).min()))  # per token for "all"
    return worst


# -- embedders ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family-encoders")
    return {
        "distilbert": make_distilbert(root / "distilbert"),  # DistilBertModel
        "electra": make_electra(root / "electra"),  # ElectraModel, with embeddings_project
        "mpnet": make_mpnet(root / "mpnet"),  # MPNetForMaskedLM (its LM head unread)
    }


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_embedder_poolings_match_transformers(embedders, reference, family, pp):
    path = embedders[family]
    ref = reference(path)
    prompts = long_prompts()
    assert max(len(ref.token_ids(p)) for p in prompts) > 150 > BUDGET
    with _engine(path, pp) as engine:
        ids = engine.tokenize(prompts)
        outs = {p: engine.pool(prompts, pooling=p, normalize=False) for p in POOLINGS}
    for text, got in zip(prompts, ids, strict=True):
        assert got.tolist() == ref.token_ids(text)
    for pooling, pooled in outs.items():
        worst = _worst_cosine(pooled, ref, prompts, pooling)
        assert worst >= MIN_COSINE, f"{family} PP={pp} {pooling}: worst cosine {worst}"


@pytest.mark.parametrize(
    "make,architecture",
    [(make_distilbert, "DistilBertForMaskedLM"), (make_electra, "ElectraForPreTraining")],
)
def test_pretraining_checkpoints_embed_as_their_encoder(tmp_path, reference, make, architecture):
    """The LM / discriminator heads are stored but not part of the encoder: skipped by name."""
    path = make(tmp_path / architecture, architecture)
    ref = reference(path)
    prompts = long_prompts()[:4]
    with _engine(path, 1) as engine:
        outs = engine.pool(prompts, pooling="cls", normalize=False)
    assert _worst_cosine(outs, ref, prompts, "cls") >= MIN_COSINE


def test_distilbert_sinusoidal_positions_are_the_stored_table(tmp_path, reference):
    """``sinusoidal_pos_embds`` only initialises the table: transformers looks up the stored
    one (here made unlike any sinusoid), and so does the engine; a checkpoint without the
    table is refused, naming it, rather than computed with a table nobody stored."""
    from safetensors.torch import load_file, save_file

    path = make_distilbert(tmp_path / "sinusoidal", sinusoidal_pos_embds=True)
    weights = load_file(path / "model.safetensors")
    name = "embeddings.position_embeddings.weight"
    weights[name] = weights[name] + 0.5 * torch.randn_like(weights[name])
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    ref = reference(path)
    prompts = long_prompts()[:4]
    with _engine(path, 1) as engine:
        outs = engine.pool(prompts, pooling="mean", normalize=False)
    assert _worst_cosine(outs, ref, prompts, "mean") >= MIN_COSINE
    del weights[name]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=re.escape(name)):
        _engine(path, 1)


@pytest.mark.parametrize(
    "family,architecture,field,value",
    [
        ("electra", "ElectraModel", "position_embedding_type", "relative_key"),
        ("mpnet", "MPNetModel", "relative_attention_num_buckets", 16),
    ],
)
def test_unimplemented_config_fields_are_refused_by_name(family, architecture, field, value):
    hf = {"model_type": family, field: value}
    with pytest.raises(ModelLoadError, match=f"{field}={value!r}"):
        check_config(hf, family=family, decoder=False, architecture=architecture)


def test_mpnet_checkpoint_exercises_its_position_bias(embedders):
    """The parity above depends on the relative position bias: with its table zeroed,
    transformers' own output moves a hundred times further than the parity bar allows, so a
    bias added wrongly (or not at all) would fail it."""
    import transformers

    path = str(embedders["mpnet"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer(long_prompts()[3])["input_ids"]])
    with torch.no_grad():
        biased = model(input_ids=ids).last_hidden_state[0].numpy()
        model.encoder.relative_attention_bias.weight.zero_()
        unbiased = model(input_ids=ids).last_hidden_state[0].numpy()
    assert 1 - cosine(biased, unbiased).min() > 100 * (1 - MIN_COSINE)


def test_mpnet_sentence_transformers_folder_matches_encode(tmp_path_factory):
    """all-mpnet-base-v2's layout (Transformer + mean Pooling + Normalize) at PP=2."""
    from sentence_transformers import SentenceTransformer

    path = make_st_mpnet(tmp_path_factory.mktemp("st-mpnet") / "st-mpnet")
    model = SentenceTransformer(str(path), device="cpu")
    prompts = long_prompts()
    expected = model.encode(prompts, batch_size=1, convert_to_numpy=True)
    with _engine(path, 2) as engine:
        ids = engine.tokenize(prompts)
        got = pipepool.SentenceTransformer(engine).encode(prompts)
    for text, got_ids in zip(prompts, ids, strict=True):
        assert got_ids.tolist() == model.tokenizer(text)["input_ids"]
    assert got.shape == expected.shape
    assert cosine(got, expected).min() >= MIN_COSINE


# -- classifiers --------------------------------------------------------------------------------


class ClassifierReference:
    """transformers' AutoModelForSequenceClassification, fp32 CPU, one input at a time; token
    types go in where the model's forward takes them (ELECTRA's, not DistilBERT's)."""

    def __init__(self, path: Path) -> None:
        import transformers

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        self.model = transformers.AutoModelForSequenceClassification.from_pretrained(
            str(path), dtype=torch.float32
        ).eval()
        self.types = "token_type_ids" in inspect.signature(self.model.forward).parameters

    def token_ids(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    @torch.no_grad()
    def logits(self, text: str, pair: str | None = None) -> np.ndarray:
        features = self.tokenizer(text, pair, return_tensors="pt")
        kwargs = {"input_ids": features["input_ids"]}
        if self.types:
            kwargs["token_type_ids"] = features["token_type_ids"]
        return self.model(**kwargs).logits[0].numpy()


@pytest.fixture(scope="module")
def classifier_paths(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family-classifiers")
    return {
        "distilbert": make_distilbert(root / "distilbert", "DistilBertForSequenceClassification"),
        "electra": make_electra(
            root / "electra", "ElectraForSequenceClassification", embedding_size=64
        ),
    }


@pytest.fixture(scope="module", params=[1, 2], ids=lambda pp: f"pp{pp}")
def pp(request) -> int:
    return request.param


@pytest.fixture(scope="module", params=["distilbert", "electra"])
def classifier(request, classifier_paths, pp):
    """(family, its reference, an engine on it at PP=pp), shared by the tests below."""
    path = classifier_paths[request.param]
    with _engine(path, pp) as engine:
        yield request.param, ClassifierReference(path), engine


def test_classifier_texts_match_transformers_logits(classifier):
    family, ref, engine = classifier
    texts = long_prompts()
    for text, ids in zip(texts, engine.tokenize(texts), strict=True):
        assert ids.tolist() == ref.token_ids(text)
    got = engine.classify(texts, use_activation=False).probs
    expected = np.stack([ref.logits(t) for t in texts])
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= TOLERANCE, family


def test_classifier_pairs_match_transformers_logits(classifier):
    """Pairs carry token types where the family reads them (ELECTRA: the document is type 1)."""
    family, ref, engine = classifier
    got = engine.score(QUERY, DOCUMENTS, use_activation=False)
    expected = np.array([ref.logits(QUERY, d)[0] for d in DOCUMENTS])
    assert np.abs(got - expected).max() <= TOLERANCE, family


# -- CUDA (skipped without a GPU) ---------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_embedder_matches_reference(embedders, reference, family):
    """fp32 on the GPU matches the fp32 CPU reference; bf16 (default settings: compiled
    bodies, CUDA graphs where the model allows them) errs no more than
    transformers' own bf16 does (docs/design.md §3)."""
    import transformers

    path = embedders[family]
    ref = reference(path)
    prompts = long_prompts()
    tf_bf16 = transformers.AutoModel.from_pretrained(str(path), dtype=torch.bfloat16).cuda()
    with _engine_cuda(path, "float32") as engine:
        for pooling in POOLINGS:
            outs = engine.pool(prompts, pooling=pooling, normalize=False)
            assert _worst_cosine(outs, ref, prompts, pooling) >= MIN_COSINE, pooling
    with _engine_cuda(path, "bfloat16") as engine:
        engine.pipeline.wait_until_compiled(600)
        for pooling in POOLINGS:
            outs = engine.pool(prompts, pooling=pooling, normalize=False)
            for text, out in zip(prompts, outs, strict=True):
                ids = ref.token_ids(text)
                expected = ref.pooled(ids, pooling)
                with torch.no_grad():
                    h = tf_bf16(input_ids=torch.tensor([ids]).cuda()).last_hidden_state[0]
                theirs = {"cls": h[0], "mean": h.mean(0), "all": h}[pooling].float().cpu()
                bar = 1.5 * (1 - cosine(theirs.numpy(), expected)) + 1e-5
                assert (1 - cosine(out, expected) <= bar).all(), (pooling, len(ids))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_mpnet_adds_its_bias_in_the_triton_kernel_inside_cuda_graphs(tmp_path, reference):
    """32-dim heads, bf16: MPNet's attention runs in the Triton kernel (the bias added there),
    inside whole-step CUDA graphs, no less accurate than transformers' bf16."""
    path = make_mpnet(tmp_path / "mpnet32", num_attention_heads=2)
    assert_triton_graphs_bf16(path, reference(path), long_prompts() + SENTENCES)


def _engine_cuda(path: Path, dtype: str) -> pipepool.Engine:
    return pipepool.Engine(str(path), device="cuda", dtype=dtype)
