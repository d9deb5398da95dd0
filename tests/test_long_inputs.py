"""Issue 15 item 2: inputs longer than max_model_len are truncated by default (as
sentence-transformers and TEI do), refused with ``long_inputs="error"`` naming the input and the
flag, or embedded window by window with ``long_inputs="chunk"`` and combined as vLLM does
(token-count-weighted mean of the windows' pooled vectors, then normalisation)."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import MIN_COSINE, SENTENCES, cosine

import pipepool
from pipepool.intake.long_inputs import split_windows

MAX_LEN = 24
LONG = " ".join(SENTENCES)  # far over MAX_LEN tokens


@pytest.fixture(scope="module")
def engine(bert_path):
    with pipepool.Engine(str(bert_path), max_model_len=MAX_LEN) as engine:
        yield engine


def _windows(ids: list[int], size: int) -> list[list[int]]:
    return [ids[k : k + size] for k in range(0, len(ids), size)]


def _combine(vectors: list[np.ndarray], weights: list[int], normalize: bool) -> np.ndarray:
    mean = np.average(np.stack(vectors), axis=0, weights=weights)
    return mean / np.linalg.norm(mean) if normalize else mean


def test_default_truncates_to_max_model_len_and_reports_the_tokens_used(engine, reference):
    submission = engine.submit([LONG, "short"])
    vectors = submission.result()
    assert submission.num_tokens[0] == MAX_LEN
    np.testing.assert_array_equal(vectors, engine.embed([LONG, "short"], truncate_prompt_tokens=-1))
    ids = engine.tokenize([LONG])[0].tolist()
    assert len(ids) == MAX_LEN and ids[-1] == engine.tokenize(["x"])[0][-1]  # [SEP] kept


def test_error_policy_names_the_input_and_the_option(engine):
    with pytest.raises(pipepool.PromptTooLongError, match=r"input 2 has \d+ tokens.*--long-inputs"):
        engine.embed(["a", "b", LONG], long_inputs="error")
    with pytest.raises(pipepool.InvalidInputError, match="long_inputs must be one of"):
        engine.embed(["a"], long_inputs="split")


@pytest.mark.parametrize("normalize", [False, True])
def test_chunk_is_the_weighted_mean_of_the_windows_against_transformers(
    engine, bert_path, reference, normalize
):
    ref = reference(bert_path)
    texts = ["short text", LONG, SENTENCES[2] * 3]
    submission = engine.submit(texts, long_inputs="chunk", normalize=normalize)
    got = submission.result()
    for i, text in enumerate(texts):
        ids = ref.token_ids(text)
        assert submission.num_tokens[i] == len(ids)  # usage: every token embedded
        windows = _windows(ids, MAX_LEN)
        want = _combine(
            [ref.pooled(w, "cls") for w in windows], [len(w) for w in windows], normalize
        )
        assert cosine(got[i], want) >= MIN_COSINE, i
        np.testing.assert_allclose(np.linalg.norm(got[i]), np.linalg.norm(want), rtol=1e-5)
    assert len(_windows(ref.token_ids(LONG), MAX_LEN)) > 3


def test_chunk_with_dimensions_cuts_after_combining(engine):
    full = engine.embed([LONG], long_inputs="chunk", normalize=False)[0]
    cut = engine.embed([LONG], long_inputs="chunk", normalize=True, dimensions=16)[0]
    np.testing.assert_allclose(cut, full[:16] / np.linalg.norm(full[:16]), rtol=1e-5, atol=1e-6)


def test_chunk_token_embeddings_are_the_windows_back_to_back(engine):
    ids = engine.tokenize([LONG], long_inputs="chunk")[0].tolist()
    (got,) = engine.embed_tokens([LONG], long_inputs="chunk")
    want = np.concatenate(engine.embed_tokens(_windows(ids, MAX_LEN)))
    assert got.shape == (len(ids), 64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_engine_option_sets_the_default_policy(bert_path):
    with pipepool.Engine(str(bert_path), max_model_len=MAX_LEN, long_inputs="error") as engine:
        with pytest.raises(pipepool.PromptTooLongError):
            engine.embed([LONG])
        assert engine.embed([LONG], long_inputs="truncate").shape == (1, 64)


def test_split_windows_cuts_by_position():
    w = split_windows(np.arange(10), np.array([3, 7]), 3)
    assert w.lengths.tolist() == [3, 3, 3, 1]
    assert w.owner.tolist() == [0, 1, 1, 1]


def test_chunk_on_a_decoder_combines_last_token_windows(qwen3_path, reference):
    ref = reference(qwen3_path)
    ids = ref.token_ids(LONG)
    windows = _windows(ids, 32)
    want = _combine([ref.pooled(w, "last") for w in windows], [len(w) for w in windows], True)
    with pipepool.Engine(str(qwen3_path), max_model_len=32, max_num_batched_tokens=16) as engine:
        (got,) = engine.embed([LONG], long_inputs="chunk", normalize=True)
    assert len(windows) > 3
    assert cosine(got, want) >= MIN_COSINE
