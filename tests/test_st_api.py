"""Issue 15 item 7: ``Engine.encode`` / ``get_sentence_embedding_dimension`` / ``similarity``
behave as ``SentenceTransformer``'s on the same folder, so code written for it runs unchanged;
an empty call returns an empty ``[0, dim]`` array."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import MIN_COSINE, SENTENCES, cosine

import pipepool

TEXTS = SENTENCES[:6]


@pytest.fixture(scope="module")
def st_model(st_bert_path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(st_bert_path), device="cpu")


@pytest.fixture(scope="module")
def engine(st_bert_path, engine_kind):
    with pipepool.Engine(str(st_bert_path), **engine_kind) as engine:
        yield engine


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"normalize_embeddings": True},
        {"prompt_name": "query"},
        {"truncate_dim": 16},
        {"truncate_dim": 16, "normalize_embeddings": True},
        {"batch_size": 2, "show_progress_bar": False},
    ],
)
def test_encode_matches_sentence_transformers(engine, st_model, kwargs):
    expected = st_model.encode(TEXTS, **kwargs)
    got = engine.encode(TEXTS, **kwargs)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    assert got.shape == expected.shape
    assert cosine(got, expected).min() >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(expected, axis=1), 1e-5)


def test_encode_one_string_gives_one_vector_and_empty_list_an_empty_array(engine, st_model):
    one = engine.encode(TEXTS[0])
    assert one.shape == st_model.encode(TEXTS[0]).shape == (32,)
    assert engine.encode([]).shape == (0, 32)
    assert engine.embed([]).shape == (0, 32)
    assert engine.embed_tokens([]) == []
    assert engine.submit([]).done()


@pytest.mark.parametrize("precision", ["int8", "uint8", "binary", "ubinary"])
def test_encode_precision_quantizes_as_sentence_transformers(engine, st_model, precision):
    from sentence_transformers.util.quantization import quantize_embeddings

    got = engine.encode(TEXTS, precision=precision)
    # Quantizing the same float vectors with sentence-transformers' own function: the engine's
    # vectors and theirs differ by float rounding, which can move a value across a bucket edge.
    expected = quantize_embeddings(engine.encode(TEXTS), precision=precision)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)
    assert got.shape == st_model.encode(TEXTS, precision=precision).shape


def test_encode_tensor_list_and_token_embeddings_outputs(engine, st_model):
    tensor = engine.encode(TEXTS, convert_to_tensor=True)
    assert isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == (len(TEXTS), 32)
    listed = engine.encode(TEXTS, convert_to_numpy=False)
    assert isinstance(listed, list) and listed[0].shape == (32,)
    tokens = engine.encode(TEXTS[:2], output_value="token_embeddings")
    expected = st_model.encode(TEXTS[:2], output_value="token_embeddings")
    for got, want in zip(tokens, expected, strict=True):
        assert got.shape == tuple(want.shape)
        assert cosine(got, want.numpy()).min() >= MIN_COSINE


def test_dimension_and_similarity_match_sentence_transformers(engine, st_model):
    assert engine.get_sentence_embedding_dimension() == st_model.get_embedding_dimension()
    assert engine.get_embedding_dimension() == st_model.get_embedding_dimension()
    a, b = engine.encode(TEXTS[:3]), engine.encode(TEXTS[3:])
    expected = st_model.similarity(a, b).numpy()
    np.testing.assert_allclose(engine.similarity(a, b), expected, atol=1e-6)


def test_encode_rejects_unknown_precision_and_output_value(engine):
    with pytest.raises(pipepool.InvalidInputError, match="precision must be one of"):
        engine.encode(TEXTS, precision="float16")
    with pytest.raises(pipepool.InvalidInputError, match="output_value must be one of"):
        engine.encode(TEXTS, output_value="logits")
