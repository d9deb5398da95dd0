"""Issue 56 item 2: int8/uint8 on one fixed scale per model (``api/int8_scale.py``). A text's
integers do not depend on the other texts of its call, approximate its float vector, and the
scale comes from the shipped calibration texts alone; sentence-transformers' per-call rule and
caller-given ranges stay available by name (``ranges=``)."""

from __future__ import annotations

import numpy as np
import pytest
from sentence_transformers.util.quantization import quantize_embeddings as st_quantize
from tiny_models import SENTENCES, cosine

import pipepool
from pipepool.api.calibration_texts import CALIBRATION_TEXTS
from pipepool.api.int8_scale import symmetric_bound
from pipepool.api.quantization import quantize_symmetric

TEXTS = SENTENCES[:12]


@pytest.fixture(scope="module")
def engine(minilm_path):
    with pipepool.Engine(str(minilm_path)) as e:
        yield e


@pytest.fixture(scope="module")
def ours(engine):
    """sentence-transformers' surface over the engine (it shares it)."""
    return pipepool.SentenceTransformer(engine)


@pytest.mark.parametrize(
    ("largest", "bound"),
    [
        (0.20995, 0.21875),  # in [1/8, 1/4): up to the next multiple of 1/64
        (0.21875, 0.21875),  # a multiple already
        (1.0, 1.0),
        (5.1, 5.5),  # in [4, 8): multiples of 1/2
        (0.0, 1.0),  # all zero: any bound gives zeros
    ],
)
def test_bound_is_the_largest_magnitude_rounded_up_to_an_eighth_octave(largest, bound):
    vectors = np.array([[0.0, -largest], [largest / 2, 0.0]], dtype=np.float32)
    assert symmetric_bound(vectors) == pytest.approx(bound, rel=1e-6)
    assert symmetric_bound([vectors[:1], vectors[1:]]) == symmetric_bound(vectors)


def test_symmetric_rule_rounds_half_to_even_and_clips():
    values = np.array([[63.5, -63.5, 31.75, 200.0, -200.0, 0.5, 1.5, 2.5]])
    # bound 127: int8 = round(v), half to even, clipped to ±127.
    int8 = quantize_symmetric(values, "int8", 127.0)
    assert int8.dtype == np.int8 and int8.tolist() == [[64, -64, 32, 127, -127, 0, 2, 2]]
    uint8 = quantize_symmetric(values, "uint8", 127.0)
    assert uint8.dtype == np.uint8 and (uint8.astype(int) - 128).tolist() == int8.tolist()
    halved = quantize_symmetric(values / 2, "int8", 127.0 / 2)  # the same scale
    np.testing.assert_array_equal(halved, int8)
    with pytest.raises(pipepool.InvalidInputError, match="int8 or uint8"):
        quantize_symmetric(values, "binary", 1.0)


def test_encode_int8_is_the_symmetric_rule_on_the_calibrated_bound(engine, ours):
    # The bound, computed independently: the calibration texts through embed.
    bound = symmetric_bound(engine.embed(list(CALIBRATION_TEXTS)))
    assert engine.int8_bound() == bound
    floats = ours.encode(TEXTS)
    for precision in ("int8", "uint8"):
        got = ours.encode(TEXTS, precision=precision)
        np.testing.assert_array_equal(got, quantize_symmetric(floats, precision, bound))


def test_a_texts_int8_does_not_depend_on_its_batch_mates(ours):
    batch = ours.encode(TEXTS, precision="int8")
    alone = np.stack([ours.encode(text, precision="int8") for text in TEXTS])
    np.testing.assert_array_equal(alone, batch)
    shuffled = ours.encode(TEXTS[::-1] + SENTENCES[30:40], precision="int8")[: len(TEXTS)]
    np.testing.assert_array_equal(shuffled[::-1], batch)
    one = ours.encode(TEXTS[0], precision="int8")
    assert len(np.unique(one)) > 20  # not one constant bucket (per-call ranges of one vector)


def test_int8_and_uint8_approximate_the_float_vectors(ours):
    floats = ours.encode(SENTENCES)
    int8 = ours.encode(SENTENCES, precision="int8").astype(np.float64)
    uint8 = ours.encode(SENTENCES, precision="uint8").astype(np.float64) - 128
    assert cosine(int8, floats).min() >= 0.99
    assert cosine(uint8, floats).min() >= 0.99
    np.testing.assert_array_equal(uint8, int8)


def test_the_bound_matches_sentence_transformers_vectors_of_the_calibration_texts(minilm_path):
    """Another implementation's float vectors (sentence-transformers, its own tokenizer and
    batching) give the same bound: float noise does not move the scale."""
    from sentence_transformers import SentenceTransformer

    st_model = SentenceTransformer(str(minilm_path), device="cpu")
    with pipepool.Engine(str(minilm_path)) as engine:
        assert engine.int8_bound() == symmetric_bound(st_model.encode(list(CALIBRATION_TEXTS)))


def test_per_call_and_given_ranges_are_sentence_transformers_rules(ours):
    floats = ours.encode(TEXTS)
    per_call = ours.encode(TEXTS, precision="int8", ranges="call")
    np.testing.assert_array_equal(per_call, st_quantize(floats, precision="int8"))
    calibration = ours.encode(SENTENCES[20:60])
    ranges = np.vstack((calibration.min(axis=0), calibration.max(axis=0)))
    given = ours.encode(TEXTS, precision="uint8", ranges=ranges)
    np.testing.assert_array_equal(given, st_quantize(floats, precision="uint8", ranges=ranges))


def test_matryoshka_and_token_outputs_have_bounds_of_their_own(engine, ours):
    cut = ours.encode(TEXTS, truncate_dim=32, normalize_embeddings=True)
    calibration = ours.encode(list(CALIBRATION_TEXTS), truncate_dim=32, normalize_embeddings=True)
    bound = symmetric_bound(calibration)
    assert bound > engine.int8_bound()  # 32 unit-length components are larger than 384
    got = ours.encode(TEXTS, precision="int8", truncate_dim=32, normalize_embeddings=True)
    np.testing.assert_array_equal(got, quantize_symmetric(cut, "int8", bound))
    assert cosine(got.astype(np.float64), cut).min() >= 0.99

    kwargs = {"output_value": "token_embeddings"}
    tokens = ours.encode(TEXTS[:3], **kwargs)
    token_bound = symmetric_bound(
        [t.numpy() for t in ours.encode(list(CALIBRATION_TEXTS), **kwargs)]
    )
    got = ours.encode(TEXTS[:3], precision="int8", **kwargs)
    for g, t in zip(got, tokens, strict=True):
        np.testing.assert_array_equal(g, quantize_symmetric(t.numpy(), "int8", token_bound))
    alone = ours.encode(TEXTS[1], precision="int8", **kwargs)
    np.testing.assert_array_equal(alone, got[1])


def test_a_bound_is_computed_once_and_known_without_waiting_after(engine):
    assert engine.int8_bound(48, wait=False) is None  # the server's event loop asks this first
    bound = engine.int8_bound(48)
    assert engine.int8_bound(48, wait=False) == bound == engine.int8_bound(48)
    assert bound == symmetric_bound(engine.embed(list(CALIBRATION_TEXTS), dimensions=48))
