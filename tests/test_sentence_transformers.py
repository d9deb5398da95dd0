"""Issue 2 acceptance: sentence-transformers folders against sentence-transformers itself.

The real all-MiniLM-L6-v2 (the default model: mean pooling + Normalize) on real sentences,
and a tiny folder with a Dense head and prompts (modules.json, 1_Pooling, 2_Dense, prompts).
"""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import MIN_COSINE, SENTENCES, cosine

import pipepool


@pytest.fixture(scope="module")
def minilm_st(minilm_path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path), device="cpu")


@pytest.fixture(scope="module")
def minilm_expected(minilm_st) -> np.ndarray:
    return minilm_st.encode(SENTENCES, convert_to_numpy=True)


@pytest.fixture(scope="module")
def st_bert(st_bert_path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(st_bert_path), device="cpu")


@pytest.fixture(scope="module")
def st_bert_engine(st_bert_path):
    with pipepool.Engine(str(st_bert_path), max_num_batched_tokens=32) as engine:
        yield engine


def test_minilm_default_engine_matches_sentence_transformers(minilm_expected):
    assert len(SENTENCES) >= 50
    with pipepool.Engine() as engine:  # the bundled all-MiniLM-L6-v2, default settings
        assert engine.info.pooling == "mean" and engine.info.normalize
        vectors = engine.embed(SENTENCES)
    assert vectors.shape == minilm_expected.shape == (len(SENTENCES), 384)
    worst = cosine(vectors, minilm_expected)
    assert worst.min() >= MIN_COSINE, f"worst sentence {int(worst.argmin())}: {worst.min()}"
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_minilm_small_budget_matches_sentence_transformers(minilm_path, minilm_st):
    texts = [*SENTENCES, "Hi", "Yes.", "A cat.", " ".join(SENTENCES[:8])]
    expected = minilm_st.encode(texts, convert_to_numpy=True)
    budget = 12
    with pipepool.Engine(str(minilm_path), max_num_batched_tokens=budget) as engine:
        lengths = [len(ids) for ids in engine.tokenize(texts)]
        vectors = engine.embed(texts)
        steps = engine.stats.steps
    # Encoders never chunk: each prompt above the budget runs alone, short ones share steps.
    above = sum(n > budget for n in lengths)
    assert above >= 10 and max(lengths) > 80
    assert above < steps < len(texts)
    worst = cosine(vectors, expected)
    assert worst.min() >= MIN_COSINE, f"worst text {int(worst.argmin())}: {worst.min()}"


@pytest.mark.parametrize("prompt_name", [None, "query", "passage"])
def test_dense_head_and_prompts_match_sentence_transformers(st_bert, st_bert_engine, prompt_name):
    texts = SENTENCES[:20]
    expected = st_bert.encode(texts, prompt_name=prompt_name, convert_to_numpy=True)
    vectors = st_bert_engine.embed(texts, prompt_name=prompt_name)
    assert vectors.shape == expected.shape == (len(texts), 32)
    assert cosine(vectors, expected).min() >= MIN_COSINE


def test_prompt_changes_the_vector(st_bert_engine):
    plain = st_bert_engine.embed(SENTENCES[:3])
    query = st_bert_engine.embed(SENTENCES[:3], prompt_name="query")
    assert cosine(plain, query).max() < 0.9999, "prompt_name had no effect"


@pytest.mark.parametrize("dim", [8, 16, 31])
def test_dimensions_match_sentence_transformers_truncate_dim(st_bert_path, st_bert_engine, dim):
    from sentence_transformers import SentenceTransformer

    texts = SENTENCES[:12]
    truncated = SentenceTransformer(str(st_bert_path), device="cpu", truncate_dim=dim)
    # sentence-transformers runs every module (Dense, then Normalize) and truncates after:
    # its truncate_dim vectors are cut from a unit vector and so are shorter than 1.
    st_plain = truncated.encode(texts, prompt_name="query", convert_to_numpy=True)
    # pipepool truncates, then normalises (as vLLM does for `dimensions`, and as
    # sentence-transformers does when also asked to normalize_embeddings).
    st_unit = truncated.encode(
        texts, prompt_name="query", normalize_embeddings=True, convert_to_numpy=True
    )
    vectors = st_bert_engine.embed(texts, prompt_name="query", dimensions=dim)
    assert vectors.shape == st_plain.shape == (len(texts), dim)
    assert cosine(vectors, st_plain).min() >= MIN_COSINE
    assert cosine(vectors, st_unit).min() >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(vectors, st_unit, atol=1e-5)
    assert np.linalg.norm(st_plain, axis=1).max() < 1.0  # the order differs only in scale


def test_minilm_dimensions_match_sentence_transformers_truncate_dim(minilm_st, minilm_path):
    from sentence_transformers import SentenceTransformer

    texts = SENTENCES[:10]
    truncated = SentenceTransformer(str(minilm_path), device="cpu", truncate_dim=128)
    expected = truncated.encode(texts, normalize_embeddings=True, convert_to_numpy=True)
    with pipepool.Engine(str(minilm_path)) as engine:
        vectors = engine.embed(texts, dimensions=128)
    assert vectors.shape == (len(texts), 128)
    assert cosine(vectors, expected).min() >= MIN_COSINE
    np.testing.assert_allclose(vectors, expected, atol=1e-5)


def test_max_model_len_is_the_sentence_transformers_max_seq_length(
    st_bert, st_bert_engine, minilm_st, minilm_path
):
    # all-MiniLM keeps it in sentence_bert_config.json (older sentence-transformers);
    # sentence-transformers 6 saves it as the tokenizer's model_max_length instead.
    assert minilm_st.max_seq_length == 256
    with pipepool.Engine(str(minilm_path)) as engine:
        assert engine.info.max_model_len == 256
    assert st_bert.max_seq_length == 256
    assert st_bert_engine.info.max_model_len == st_bert.max_seq_length


def test_prompt_over_max_seq_length_truncated_like_sentence_transformers(st_bert, st_bert_engine):
    text = " ".join(SENTENCES)  # far more than 256 tokens
    assert len(st_bert.tokenizer(text)["input_ids"]) > 300
    with pytest.raises(pipepool.PromptTooLongError, match="max_model_len=256"):
        st_bert_engine.embed([text], long_inputs="error")
    # sentence-transformers truncates silently at max_seq_length; so does pipepool by default
    # (and when asked to with truncate_prompt_tokens=-1).
    expected = st_bert.encode([text], convert_to_numpy=True)
    assert cosine(st_bert_engine.embed([text]), expected).min() >= MIN_COSINE
    vectors = st_bert_engine.embed([text], truncate_prompt_tokens=-1)
    assert cosine(vectors, expected).min() >= MIN_COSINE
