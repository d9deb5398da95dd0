"""The tokenizer helper process (``intake/tokenizer_process.py``): a large batch tokenised there
gives the very arrays the server's own process gives, errors come back as they were raised, a
helper that died or hung is replaced (the batch tokenised in the caller's process meanwhile),
and a closed one leaves the tokenizer working on its own."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from tiny_models import SENTENCES, minilm_path

from pipepool.intake.tokenizer import OFFLOAD_CHARS, Tokenizer
from pipepool.intake.tokenizer_process import ANSWER_TIMEOUT_S, TokenizerProcess, helper_threads

# Texts of ~80-240 characters, enough of them to pass OFFLOAD_CHARS.
TEXTS = [" ".join(SENTENCES[i % len(SENTENCES)] for i in range(k % 3 + 1)) for k in range(300)]


@pytest.fixture(scope="module")
def tokenizers():
    path = minilm_path() / "tokenizer.json"
    local, offloading = Tokenizer(path), Tokenizer(path)
    offloading.use_helper(TokenizerProcess(path))
    yield local, offloading
    offloading.close()


def _equal(a: tuple, b: tuple) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


def test_a_large_batch_goes_to_the_helper_and_gives_the_same_arrays(tokenizers):
    local, offloading = tokenizers
    assert sum(map(len, TEXTS)) >= OFFLOAD_CHARS
    calls = []
    run = offloading._helper.run
    offloading._helper.run = lambda *a, **k: calls.append(a[0]) or run(*a, **k)
    try:
        for options in ({}, {"max_tokens": 12}, {"max_tokens": 12, "keep": "last"}):
            _equal(offloading.encode_flat(TEXTS, **options), local.encode_flat(TEXTS, **options))
        queries, documents = TEXTS[::-1], TEXTS
        for limit in (None, 20):
            _equal(
                offloading.encode_pairs(queries, documents, max_tokens=limit),
                local.encode_pairs(queries, documents, max_tokens=limit),
            )
        small = TEXTS[:3]  # under OFFLOAD_CHARS: tokenised here
        _equal(offloading.encode_flat(small), local.encode_flat(small))
    finally:
        del offloading._helper.run
    assert calls == ["encode_flat"] * 3 + ["encode_pairs"] * 2


def test_an_error_in_the_helper_is_raised_to_the_caller(tokenizers):
    _, offloading = tokenizers
    with pytest.raises(ValueError, match="zip"):  # strict zip: pairs of unequal lists
        offloading.encode_pairs(TEXTS, TEXTS[:-1])


def test_a_helper_that_died_is_replaced(tokenizers):
    local, offloading = tokenizers
    first = offloading._helper.pid
    os.kill(first, signal.SIGKILL)
    offloading._helper._process.wait(timeout=10)
    _equal(offloading.encode_flat(TEXTS), local.encode_flat(TEXTS))
    assert offloading._helper.pid not in (None, first)


def test_a_closed_helper_exits_and_the_tokenizer_works_alone():
    path = minilm_path() / "tokenizer.json"
    tokenizer = Tokenizer(path)
    tokenizer.use_helper(TokenizerProcess(path))
    process = tokenizer._helper._process
    tokenizer.close()
    assert process.poll() is not None  # exited
    _equal(tokenizer.encode_flat(TEXTS), Tokenizer(path).encode_flat(TEXTS))


def test_a_hung_helper_is_killed_and_the_batch_tokenised_here(tokenizers):
    local, offloading = tokenizers
    helper = offloading._helper
    stopped = helper.pid
    os.kill(stopped, signal.SIGSTOP)  # alive, never answering
    helper.answer_timeout_s = 0.5
    try:
        _equal(offloading.encode_flat(TEXTS), local.encode_flat(TEXTS))
    finally:
        helper.answer_timeout_s = ANSWER_TIMEOUT_S
    assert helper.pid is None  # killed; the next batch starts another
    _equal(offloading.encode_flat(TEXTS), local.encode_flat(TEXTS))
    assert helper.pid not in (None, stopped)


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode() for k, v in pairs}


def test_one_models_helpers_share_half_the_cores_between_the_front_ends():
    assert helper_threads(1, cores=16) == 8
    assert helper_threads(4, cores=16) == 2  # four front ends' helpers of a flooded model: 8
    assert helper_threads(3, cores=16) == 2
    assert helper_threads(4, cores=2) == 1  # at least one each


def test_a_helper_encodes_on_the_pool_it_is_given_unless_the_user_chose(monkeypatch):
    """Its environment read once it has answered (so it runs the helper's program)."""
    path = minilm_path() / "tokenizer.json"
    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    local, given = Tokenizer(path), Tokenizer(path)
    given.use_helper(helper := TokenizerProcess(path, threads=2))
    try:
        _equal(given.encode_flat(TEXTS), local.encode_flat(TEXTS))
        assert helper.pid is not None
        assert _environ(helper.pid)["RAYON_NUM_THREADS"] == "2"
    finally:
        given.close()
    monkeypatch.setenv("RAYON_NUM_THREADS", "3")
    chosen = TokenizerProcess(path, threads=2)
    try:
        chosen.run("encode_flat", TEXTS[:2])
        assert chosen.pid is not None
        assert _environ(chosen.pid)["RAYON_NUM_THREADS"] == "3"
    finally:
        chosen.close()
