"""Small calls that arrive together are tokenised as one batch (``intake.shared_batches``): a
lone call goes straight through, calls queued behind a batch in progress become the next batch
(in order of arrival, each given its own results), an error reaches every call of its batch;
and through the tokenizer, concurrent calls get the ids of calls made one at a time."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from tiny_models import SENTENCES, minilm_path

from pipepool.intake.shared_batches import SharedBatches
from pipepool.intake.tokenizer import Tokenizer


class _Encoder:
    """``encode`` of texts as their upper case, recording each batch; the first batch waits
    until ``release`` is set, the batches with a text "bad" raise."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, texts: list[str]) -> list[str]:
        self.batches.append(list(texts))
        if len(self.batches) == 1:
            self.entered.set()
            assert self.release.wait(10)
        if "bad" in texts:
            raise ValueError("a bad text")
        return [t.upper() for t in texts]


def _queued(shared: SharedBatches, count: int) -> None:
    """Wait until ``count`` calls are queued behind the batch in progress."""
    deadline = threading.Event()
    for _ in range(1000):
        with shared._lock:
            if len(shared._queued) >= count:
                return
        deadline.wait(0.01)
    raise AssertionError(f"{count} calls never queued")


def test_a_lone_call_goes_straight_through():
    encoder = _Encoder()
    encoder.release.set()
    shared = SharedBatches(encoder)
    assert shared.encodings(["a", "b"]) == ["A", "B"]
    assert shared.encodings(["c"]) == ["C"]
    assert encoder.batches == [["a", "b"], ["c"]]


def test_calls_behind_a_batch_in_progress_are_the_next_batch():
    encoder = _Encoder()
    shared = SharedBatches(encoder)
    with ThreadPoolExecutor(4) as threads:
        first = threads.submit(shared.encodings, ["first"])
        assert encoder.entered.wait(10)
        later = []
        for i, texts in enumerate((["x", "y"], ["z"], ["w"])):
            later.append(threads.submit(shared.encodings, texts))
            _queued(shared, i + 1)  # in this order
        encoder.release.set()
        assert first.result(10) == ["FIRST"]
        assert [f.result(10) for f in later] == [["X", "Y"], ["Z"], ["W"]]
    assert encoder.batches == [["first"], ["x", "y", "z", "w"]]


def test_an_error_reaches_every_call_of_its_batch_and_the_next_calls_go_on():
    encoder = _Encoder()
    shared = SharedBatches(encoder)
    with ThreadPoolExecutor(3) as threads:
        first = threads.submit(shared.encodings, ["first"])
        assert encoder.entered.wait(10)
        good = threads.submit(shared.encodings, ["good"])
        _queued(shared, 1)
        bad = threads.submit(shared.encodings, ["bad"])
        _queued(shared, 2)
        encoder.release.set()
        assert first.result(10) == ["FIRST"]
        for f in (good, bad):
            with pytest.raises(ValueError, match="a bad text"):
                f.result(10)
    assert shared.encodings(["after"]) == ["AFTER"]


def test_concurrent_calls_get_the_ids_of_calls_made_one_at_a_time():
    path = minilm_path() / "tokenizer.json"
    shared, alone = Tokenizer(path), Tokenizer(path)
    calls = []
    for k in range(60):  # 1-12 texts each, some truncated, from either end
        texts = [f"{SENTENCES[(k + i) % len(SENTENCES)]} {k}" for i in range(k % 12 + 1)]
        options = [{}, {"max_tokens": 6}, {"max_tokens": 6, "keep": "last"}][k % 3]
        calls.append((texts, options))
    with ThreadPoolExecutor(8) as threads:
        got = list(threads.map(lambda c: shared.encode_flat(c[0], **c[1]), calls))
    for (texts, options), (flat, lengths) in zip(calls, got, strict=True):
        want_flat, want_lengths = alone.encode_flat(texts, **options)
        np.testing.assert_array_equal(flat, want_flat)
        np.testing.assert_array_equal(lengths, want_lengths)
