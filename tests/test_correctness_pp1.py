"""Issue 2 acceptance: one stage, chunked prefill, every pooler, against transformers."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import MIN_COSINE, cosine, long_prompts

import pipepool

POOLINGS = ("last", "mean", "cls", "all")


def _check_against_reference(engine, ref, prompts, pooling):
    outs = engine.pool(prompts, pooling=pooling, normalize=False)
    worst = 1.0
    for text, out in zip(prompts, outs, strict=True):
        expected = ref.pooled(ref.token_ids(text), pooling)
        assert out.shape == expected.shape
        worst = min(worst, float(cosine(out, expected).min()))  # per token for "all"
    assert worst >= MIN_COSINE, f"{pooling}: worst cosine {worst}"


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama", "mistral"])
@pytest.mark.parametrize("budget", [7, 16, 64, 4096])
def test_decoder_chunked_prefill_matches_transformers(decoder_paths, reference, family, budget):
    path = decoder_paths[family]
    ref = reference(path)
    prompts = long_prompts()
    lengths = [len(ref.token_ids(p)) for p in prompts]
    assert max(lengths) >= 150 and min(lengths) <= 4
    with pipepool.Engine(str(path), max_num_batched_tokens=budget, max_num_seqs=8) as engine:
        for pooling in POOLINGS:
            _check_against_reference(engine, ref, prompts, pooling)
        if budget < max(lengths):
            assert engine.stats.chunked_requests > 0, "the token budget never forced chunking"
        # A 1-token prompt (token ids in, as no text tokenizes to a single token here).
        token = [int(ref.token_ids("hello")[0])]
        for pooling in POOLINGS:
            out = engine.pool([token], pooling=pooling, normalize=False)[0]
            assert cosine(out, ref.pooled(token, pooling)).min() >= MIN_COSINE


@pytest.mark.parametrize("budget", [7, 64, 4096])
def test_encoder_whole_prompts_match_transformers(bert_path, reference, budget):
    ref = reference(bert_path)
    prompts = long_prompts()
    with pipepool.Engine(str(bert_path), max_num_batched_tokens=budget) as engine:
        for pooling in POOLINGS:
            _check_against_reference(engine, ref, prompts, pooling)


def test_xlm_roberta_positions_match_transformers(xlmr_path, reference):
    ref = reference(xlmr_path)
    with pipepool.Engine(str(xlmr_path), max_num_batched_tokens=64) as engine:
        for pooling in ("cls", "mean"):
            _check_against_reference(engine, ref, long_prompts()[:6], pooling)


def test_embed_normalizes_and_truncates_dimensions(qwen3_path, reference):
    ref = reference(qwen3_path)
    text = long_prompts()[3]
    expected = ref.pooled(ref.token_ids(text), "last")
    with pipepool.Engine(str(qwen3_path), max_num_batched_tokens=16) as engine:
        full = engine.embed([text])
        assert full.shape == (1, 64) and abs(np.linalg.norm(full[0]) - 1) < 1e-5
        assert cosine(full[0], expected) >= MIN_COSINE
        short = engine.embed([text], dimensions=16)
        assert short.shape == (1, 16) and abs(np.linalg.norm(short[0]) - 1) < 1e-5
        assert cosine(short[0], expected[:16]) >= MIN_COSINE
        raw = engine.embed([text], normalize=False)
        np.testing.assert_allclose(raw[0], expected, rtol=1e-4, atol=1e-5)


def test_results_do_not_depend_on_batch_company(qwen3_path):
    prompts = long_prompts()
    with pipepool.Engine(str(qwen3_path), max_num_batched_tokens=32) as engine:
        together = engine.embed(prompts)
        alone = np.stack([engine.embed([p])[0] for p in prompts])
        reversed_order = engine.embed(prompts[::-1])[::-1]
    assert cosine(together, alone).min() >= MIN_COSINE
    assert cosine(together, reversed_order).min() >= MIN_COSINE


def test_embed_tokens_returns_one_array_per_input(bert_path, reference):
    ref = reference(bert_path)
    texts = ["a short one", long_prompts()[2]]
    with pipepool.Engine(str(bert_path)) as engine:
        outs = engine.embed_tokens(texts)
    assert [o.shape for o in outs] == [(len(ref.token_ids(t)), 64) for t in texts]


SENTENCE_TRANSFORMERS_MODES = ("max", "mean_sqrt_len", "weightedmean")


@pytest.mark.parametrize("pp", [1, 2])
def test_sentence_transformers_pooling_modes_chunked_match_the_reference(
    decoder_paths, bert_path, reference, pp
):
    """max, mean_sqrt_len and weightedmean over a causal model's chunked prompts (running
    state across chunks) and an encoder's whole ones, against the hidden states of
    transformers pooled independently."""
    for path in (decoder_paths["qwen3"], bert_path):
        ref = reference(path)
        prompts = long_prompts()
        with pipepool.Engine(
            str(path), pipeline_parallel_size=pp, max_num_batched_tokens=7
        ) as engine:
            for pooling in SENTENCE_TRANSFORMERS_MODES:
                _check_against_reference(engine, ref, prompts, pooling)
            if engine.info.causal:
                assert engine.stats.chunked_requests > 0


@pytest.mark.parametrize("mode", ["max", "mean_sqrt_len_tokens", "weightedmean"])
def test_sentence_transformers_folder_with_each_pooling_mode(model_dir, mode):
    import tiny_models
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    folder = model_dir / f"st-pooling-{mode}"
    if not (folder / "modules.json").exists():
        bert_dir = tiny_models.make_bert(model_dir / f"st-pooling-{mode}-transformer")
        st = SentenceTransformer(
            modules=[modules.Transformer(str(bert_dir)), modules.Pooling(64, pooling_mode=mode)],
            device="cpu",
        )
        st.save(str(folder))
    texts = long_prompts()[:5]
    expected = SentenceTransformer(str(folder), device="cpu").encode(texts)
    with pipepool.Engine(str(folder), pipeline_parallel_size=2) as engine:
        got = pipepool.SentenceTransformer(engine).encode(texts)
    assert cosine(got, expected).min() >= MIN_COSINE
