"""A call's slices tokenised ahead of the enqueueing thread (``intake.read_ahead``): in order,
a bounded number ahead, errors where they happened, a closed call's thread stopped; and texts
through it give the token-id path's vectors."""

from __future__ import annotations

import functools
import threading

import numpy as np
import pytest
from tiny_models import SENTENCES

import pipepool
from pipepool.api import st_compat
from pipepool.intake import inputs
from pipepool.intake.read_ahead import read_ahead


class _Tasks:
    """Tasks 0..n-1 that return their index, recording how many started, and on which
    threads; task ``hold_at`` waits until released, task ``fail_at`` raises."""

    def __init__(self, n: int, hold_at: int | None = None, fail_at: int | None = None) -> None:
        self.n, self.hold_at, self.fail_at = n, hold_at, fail_at
        self.started = 0
        self.threads: set[str] = set()
        self.release = threading.Event()
        self.progress = threading.Condition()

    def __iter__(self):
        return (functools.partial(self._run, i) for i in range(self.n))

    def _run(self, i: int) -> int:
        with self.progress:
            self.started += 1
            self.threads.add(threading.current_thread().name)
            self.progress.notify_all()
        if i == self.hold_at:
            self.release.wait(10)
        if i == self.fail_at:
            raise ValueError(f"task {i} is bad")
        return i

    def wait_started(self, count: int) -> None:
        with self.progress:
            assert self.progress.wait_for(lambda: self.started >= count, 10)


def test_results_come_in_order_from_threads_of_their_own():
    tasks = _Tasks(50)
    assert list(read_ahead(tasks, ahead=3)) == list(range(50))
    assert tasks.threads and all(t.startswith("pipepool-read-ahead") for t in tasks.threads)


@pytest.mark.parametrize("ahead", [1, 2, 4])
def test_at_most_ahead_tasks_are_started_before_their_results_are_taken(ahead):
    tasks = _Tasks(100)
    results = read_ahead(tasks, ahead=ahead)
    for taken in range(1, 6):
        next(results)
        most = taken + ahead
        tasks.wait_started(most)  # it does go ahead ...
        with tasks.progress:  # ... and stops there: one more starts only once one is taken
            assert not tasks.progress.wait_for(lambda m=most: tasks.started > m, 0.05)
    results.close()


def test_an_error_is_raised_where_it_happened_after_the_results_before_it():
    results = read_ahead(_Tasks(10, fail_at=4), ahead=2)
    assert [next(results) for _ in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="task 4 is bad"):
        next(results)


def test_closing_starts_no_more_tasks():
    tasks = _Tasks(1000, hold_at=2)
    results = read_ahead(tasks, ahead=2)
    assert next(results) == 0
    tasks.wait_started(3)  # tasks 1 and 2 (held) started
    results.close()
    tasks.release.set()
    for t in threading.enumerate():
        if t.name.startswith("pipepool-read-ahead"):
            t.join(10)
    assert tasks.started == 3


@pytest.fixture(scope="module")
def engine(bert_path):
    # Batch-invariant: a text's vector does not depend on the steps it shared, so the text
    # path's vectors must equal the token-id path's bit for bit however each was sliced.
    with pipepool.Engine(
        str(bert_path), device="cpu", max_model_len=128, batch_invariant=True
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


def test_sentence_transformers_encode_in_several_slices_gives_the_same_vectors(engine, monkeypatch):
    texts = [f"{SENTENCES[i % len(SENTENCES)]} {i}" for i in range(45)]
    model = pipepool.SentenceTransformer(engine)
    whole = model.encode(texts)  # one slice
    monkeypatch.setattr(st_compat, "FIRST_SLICE", 4)
    monkeypatch.setattr(st_compat, "SLICE", 8)
    np.testing.assert_array_equal(model.encode(texts), whole)
