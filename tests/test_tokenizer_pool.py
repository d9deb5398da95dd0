"""An engine's tokenizer processes (``intake/tokenizer_pool.py``): a batch split between them
gives the very arrays of one process's call, in order; a process that died costs the call
nothing (tokenised in the engine's process) and is started again; an engine with a pool gives
the token-id path's vectors and stops its processes when closed; the default size."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from tiny_models import SENTENCES, minilm_path

import pipepool
from pipepool.intake.tokenizer import OFFLOAD_CHARS, Tokenizer
from pipepool.intake.tokenizer_pool import MIN_CHUNK, TokenizerPool, pool_size

# Texts of ~80-240 characters, none alike: several chunks of the pool, past OFFLOAD_CHARS.
TEXTS = [
    " ".join(SENTENCES[(k + i) % len(SENTENCES)] for i in range(k % 3 + 1)) + f" {k}"
    for k in range(5 * MIN_CHUNK + 3)
]


@pytest.fixture(scope="module")
def tokenizers():
    path = minilm_path() / "tokenizer.json"
    local, pooled = Tokenizer(path), Tokenizer(path)
    pooled.use_helper(TokenizerPool(path, 2))
    yield local, pooled
    pooled.close()


def _equal(a: tuple, b: tuple) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


def test_a_batch_split_between_the_processes_gives_one_calls_arrays(tokenizers):
    local, pooled = tokenizers
    assert sum(map(len, TEXTS)) >= OFFLOAD_CHARS
    pool = pooled._helper
    chunks = []
    in_one = pool._in_one
    pool._in_one = lambda method, *a, **k: chunks.append(len(a[0])) or in_one(method, *a, **k)
    try:
        for options in ({}, {"max_tokens": 12}, {"max_tokens": 12, "keep": "last"}):
            _equal(pooled.encode_flat(TEXTS, **options), local.encode_flat(TEXTS, **options))
        for limit in (None, 20):
            _equal(
                pooled.encode_pairs(TEXTS[::-1], TEXTS, max_tokens=limit),
                local.encode_pairs(TEXTS[::-1], TEXTS, max_tokens=limit),
            )
        # One chunk per process: 5 calls of 2 chunks.
        half = -(-len(TEXTS) // 2)
        assert chunks == [half, len(TEXTS) - half] * 5
        # Chunks of MIN_CHUNK texts at least, however many processes there are.
        chunks.clear()
        few = TEXTS[: MIN_CHUNK + 5]
        _equal(pool.run("encode_flat", few), local.encode_flat(few))
        assert chunks == [MIN_CHUNK, 5]
    finally:
        del pool._in_one


def test_an_error_in_a_process_is_raised_to_the_caller(tokenizers):
    _, pooled = tokenizers
    with pytest.raises(ValueError, match="zip"):  # strict zip: pairs of unequal lists
        pooled.encode_pairs(TEXTS, TEXTS[:-1])


def test_a_process_that_died_costs_the_call_nothing_and_is_started_again(tokenizers):
    local, pooled = tokenizers
    pool = pooled._helper
    killed = pool.pids[0]
    os.kill(killed, signal.SIGKILL)
    pool._helpers[0]._process.wait(timeout=10)
    _equal(pooled.encode_flat(TEXTS), local.encode_flat(TEXTS))
    _equal(pooled.encode_flat(TEXTS), local.encode_flat(TEXTS))
    assert None not in pool.pids and killed not in pool.pids


def test_an_engine_with_processes_gives_the_token_id_paths_vectors(bert_path):
    with pipepool.Engine(
        str(bert_path), device="cpu", batch_invariant=True, tokenizer_processes=2
    ) as engine:
        pool = engine.tokenizer._helper
        assert isinstance(pool, TokenizerPool) and pool.processes == 2
        texts = TEXTS  # a slice past OFFLOAD_CHARS: through the pool
        ids = engine.tokenize(texts)
        assert [a.tolist() for a in ids] == [a.tolist() for a in Tokenizer(
            bert_path / "tokenizer.json"
        ).encode_batch(texts)]  # fmt: skip
        np.testing.assert_array_equal(engine.embed(texts), engine.embed(ids))
        processes = [h._process for h in pool._helpers]
    assert all(p is None or p.poll() is not None for p in processes)  # closed with the engine


def test_the_default_size_leaves_the_cpu_engines_cores_to_the_model():
    assert pool_size(None, cuda=True, cores=16) == 14
    assert pool_size(None, cuda=True, cores=4) == 0  # a small host: in the engine's process
    assert pool_size(None, cuda=False, cores=64) == 0  # the CPU computes the model
    assert pool_size(3, cuda=False, cores=2) == 3  # asked for: given
    assert pool_size(0, cuda=True, cores=16) == 0


def test_a_bad_size_is_refused_by_name(bert_path):
    for bad in (-1, 1.5, True):
        with pytest.raises(pipepool.InvalidInputError, match="tokenizer_processes") as info:
            pipepool.Engine(str(bert_path), device="cpu", tokenizer_processes=bad)
        assert info.value.param == "tokenizer_processes"
