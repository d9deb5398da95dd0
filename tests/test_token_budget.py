"""A call's token budget (``intake.token_budget``), counted on the slices the engine
tokenises: a call over it is refused naming the counts before anything of it is enqueued, one
within it gives what the call without a budget gives, and the server's embedding limit
(``server.limits.embedding_call``) tokenises each text once, through the engine."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import numpy as np
import pytest
from tiny_models import SENTENCES

import pipepool
from pipepool.intake.token_budget import InputOverBudgetError, TokenBudget, TokenBudgetError
from pipepool.server.errors import APIError
from pipepool.server.limits import embedding_call
from pipepool.server.settings import ServerSettings

MAX_LEN = 64


@pytest.fixture(scope="module")
def engine(minilm_path):
    with pipepool.Engine(str(minilm_path), device="cpu", max_model_len=MAX_LEN) as e:
        yield e


@pytest.fixture
def tokenised(engine, monkeypatch) -> list[str]:
    """Every text the engine's tokenizer is given from now on, in order."""
    seen: list[str] = []
    tokenizer = engine.tokenizer
    encode_flat = tokenizer.encode_flat

    def counted(texts, **kwargs):
        seen.extend(texts)
        return encode_flat(texts, **kwargs)

    monkeypatch.setattr(tokenizer, "encode_flat", counted)
    return seen


def test_a_call_within_its_budget_is_the_call_without_one(engine):
    lengths = [len(ids) for ids in engine.tokenize(SENTENCES[:6])]
    budget = TokenBudget(sum(lengths), max(lengths))  # exactly enough: not bounded in advance
    got = engine.submit(SENTENCES[:6], budget=budget).result()
    np.testing.assert_array_equal(got, engine.submit(SENTENCES[:6]).result())


def test_a_call_over_its_budget_is_refused_with_its_counts_before_anything_is_enqueued(engine):
    lengths = [len(ids) for ids in engine.tokenize(SENTENCES[:6])]
    before = engine.stats.requests_submitted
    with pytest.raises(TokenBudgetError) as e:
        engine.submit(SENTENCES[:6], budget=TokenBudget(sum(lengths) - 1))
    assert (e.value.counted, e.value.limit, e.value.complete) == (sum(lengths), sum(lengths) - 1,
                                                                  None)  # fmt: skip
    # Counted a slice at a time: the count stops at the first slice over the budget.
    with pytest.raises(TokenBudgetError) as e:
        list(engine.token_slices(
            SENTENCES[:6], slice_size=2, budget=TokenBudget(lengths[0] + lengths[1])
        ))  # fmt: skip
    assert (e.value.counted, e.value.complete) == (sum(lengths[:4]), 4)
    longest = int(np.argmax(lengths))
    with pytest.raises(InputOverBudgetError) as over:
        engine.submit(SENTENCES[:6], budget=TokenBudget(10_000, lengths[longest] - 1))
    assert (over.value.index, over.value.tokens) == (longest, lengths[longest])
    assert engine.stats.requests_submitted == before
    for error in (e.value, over.value):
        again = pickle.loads(pickle.dumps(error))
        assert (type(again), str(again)) == (type(error), str(error))


def test_a_budget_that_bounds_the_call_in_advance_counts_nothing(engine):
    # 6 inputs cut at 8 tokens: 48 tokens at most, within 48 whatever the texts.
    budget = TokenBudget(48, 8)
    assert budget.bounds(6, 8) and not budget.bounds(7, 8) and not budget.bounds(6, None)
    got = engine.submit(SENTENCES[:6], truncate_prompt_tokens=8, budget=budget).result()
    want = engine.submit(SENTENCES[:6], truncate_prompt_tokens=8).result()
    np.testing.assert_array_equal(got, want)


def test_the_servers_limit_tokenises_each_text_once_and_words_its_400(engine, tokenised):
    texts = SENTENCES[:6]
    settings = ServerSettings(max_tokens_per_request=10_000)
    _submit(settings, engine, texts, "input").result()
    assert sorted(tokenised) == sorted(texts)
    tokenised.clear()
    total = sum(len(ids) for ids in engine.tokenize(texts))
    tokenised.clear()
    settings = ServerSettings(max_tokens_per_request=total - 1)
    with pytest.raises(APIError) as e:
        _submit(settings, engine, texts, "texts")
    assert (e.value.status, e.value.code, e.value.param) == (400, "too_many_tokens", "texts")
    assert f"the request has {total} tokens; this server takes at most {total - 1} tokens" in (
        e.value.message
    )
    assert sorted(tokenised) == sorted(texts)


def _submit(settings: ServerSettings, engine, texts: list[str], param: str):
    """What the server's tokenising thread runs of an embedding request of ``texts``."""
    work = embedding_call(settings, SimpleNamespace(engine=engine), texts, {}, param)
    assert work.submit is not None
    return work.submit(engine)
