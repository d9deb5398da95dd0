"""A call's slices tokenised ahead of the enqueueing thread (``intake.read_ahead``): in order,
a bounded number ahead, errors where they happened, a closed call's thread stopped; and texts
through it give the token-id path's vectors."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from tiny_models import SENTENCES

import pipepool
from pipepool.intake import inputs
from pipepool.intake.read_ahead import read_ahead


class _Counted:
    """Items 0..n-1, recording how many were made and on which thread; waits at item
    ``hold_at`` until released."""

    def __init__(self, n: int, hold_at: int | None = None, fail_at: int | None = None) -> None:
        self.n, self.hold_at, self.fail_at = n, hold_at, fail_at
        self.made = 0
        self.threads: set[str] = set()
        self.release = threading.Event()
        self.closed = threading.Event()
        self.progress = threading.Condition()

    def __call__(self):
        try:
            for i in range(self.n):
                if i == self.hold_at:
                    self.release.wait(10)
                if i == self.fail_at:
                    raise ValueError(f"item {i} is bad")
                self.threads.add(threading.current_thread().name)
                with self.progress:
                    self.made += 1
                    self.progress.notify_all()
                yield i
        finally:
            self.closed.set()

    def wait_made(self, count: int) -> None:
        with self.progress:
            assert self.progress.wait_for(lambda: self.made >= count, 10)


def test_items_come_in_order_from_a_thread_of_their_own():
    source = _Counted(50)
    assert list(read_ahead(source, ahead=3)) == list(range(50))
    assert source.threads == {"pipepool-read-ahead"}
    assert source.closed.wait(10)


@pytest.mark.parametrize("ahead", [1, 2, 4])
def test_at_most_ahead_items_are_made_before_they_are_taken(ahead):
    source = _Counted(100)
    items = read_ahead(source, ahead=ahead)
    for taken in range(1, 6):
        next(items)
        most = taken + ahead
        source.wait_made(most)  # it does go ahead ...
        with source.progress:  # ... and stops there: one more is made only once one is taken
            assert not source.progress.wait_for(lambda m=most: source.made > m, 0.05)
    items.close()


def test_an_error_is_raised_where_it_happened_after_the_items_before_it():
    source = _Counted(10, fail_at=4)
    items = read_ahead(source, ahead=2)
    assert [next(items) for _ in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="item 4 is bad"):
        next(items)


def test_closing_stops_the_thread_and_drops_what_it_made():
    source = _Counted(1000, hold_at=3)
    items = read_ahead(source, ahead=2)
    assert next(items) == 0
    items.close()  # the thread is held at item 3, then finds itself stopped
    source.release.set()
    assert source.closed.wait(10)
    assert source.made <= 3
    assert not any(t.name == "pipepool-read-ahead" and t.is_alive() for t in _settled())


def _settled() -> list[threading.Thread]:
    for t in threading.enumerate():
        if t.name == "pipepool-read-ahead":
            t.join(10)
    return threading.enumerate()


@pytest.fixture(scope="module")
def engine(minilm_path):
    # Batch-invariant: a text's vector does not depend on the steps it shared, so the text
    # path's vectors must equal the token-id path's bit for bit however each was sliced.
    with pipepool.Engine(
        str(minilm_path), device="cpu", max_model_len=128, batch_invariant=True
    ) as e:
        yield e


@pytest.fixture
def small_slices(monkeypatch):
    """Slices of 4 texts, then 8 (``FIRST_SLICE``, ``SLICE``): many slices in a small call."""
    monkeypatch.setattr(inputs, "FIRST_SLICE", 4)
    monkeypatch.setattr(inputs, "SLICE", 8)


def test_texts_of_several_slices_give_the_token_id_paths_vectors(engine, small_slices):
    texts = [f"{SENTENCES[i % len(SENTENCES)]} {i}" for i in range(45)]  # none alike
    tokenised = engine.tokenize(texts)
    assert [a.tolist() for a in tokenised] == [
        engine.tokenizer.encode_batch([t])[0].tolist() for t in texts
    ]
    np.testing.assert_array_equal(engine.embed(texts), engine.embed(tokenised))
    truncated = engine.tokenize(texts, truncate_prompt_tokens=6, truncation_side="left")
    assert [a.tolist() for a in truncated] == [
        a.tolist() for a in engine.tokenizer.encode_batch(texts, max_tokens=6, keep="last")
    ]


def test_an_input_over_the_limit_in_a_later_slice_is_refused_by_its_index(engine, small_slices):
    texts = ["a short one"] * 21 + ["word " * 400, "another"]
    with pytest.raises(pipepool.PromptTooLongError, match="input 21 has"):
        engine.embed(texts, long_inputs="error")
    # Its slices before it were enqueued and then cancelled: the engine goes on serving.
    np.testing.assert_array_equal(engine.embed(texts[:3]), engine.embed(engine.tokenize(texts[:3])))
