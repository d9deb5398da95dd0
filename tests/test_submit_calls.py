"""``Engine.submit`` makes no Python call per input on the calling thread: the common calls
(texts, token-id lists, arrays) are told apart and checked by whole-call passes, so a call of
thousands of inputs costs the thread that enqueues it what a call of a few does, plus its
slices. A per-input look crept in once and cost short token-id queries a third of their
throughput on the GPU (docs/benchmarks/gpu-throughput.md); this counts such work, not time."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import pipepool

SMALL, LARGE = 64, 4096
# Python calls the larger call may add, per input it adds: its slices' and waits' calls come
# to well under one an input; any per-input call makes at least one (a per-input look made
# four, the item-by-item check of id lists two).
CALLS_PER_INPUT = 0.25


@pytest.fixture(scope="module")
def engine(st_bert_path):
    with pipepool.Engine(str(st_bert_path)) as engine:
        yield engine


def python_calls(fn) -> int:
    """Python function calls (generator resumptions included) made on this thread by ``fn``."""
    calls = 0

    def hook(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(hook)
    try:
        submission = fn()
    finally:
        sys.setprofile(None)
    submission.result()  # waited for outside the count: the waits' wake-ups vary
    return calls


def _texts(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
    return [" ".join(rng.choice(words, size=int(rng.integers(3, 12)))) for _ in range(n)]


@pytest.mark.parametrize("kind", ["texts", "id lists", "id arrays", "id tuples"])
def test_submit_makes_no_python_call_per_input(engine, kind):
    def inputs(n: int):
        texts = _texts(n)
        if kind == "texts":
            return texts
        arrays = engine.tokenize(texts)
        if kind == "id arrays":
            return arrays
        if kind == "id tuples":
            return tuple(list(map(int, a)) for a in arrays)
        return [list(map(int, a)) for a in arrays]

    small, large = inputs(SMALL), inputs(LARGE)
    engine.submit(small).result()  # warm: first-call imports and caches out of the count
    added = python_calls(lambda: engine.submit(large)) - python_calls(lambda: engine.submit(small))
    assert added < CALLS_PER_INPUT * (LARGE - SMALL), f"{added} more Python calls"
