"""A step's outputs into their calls' results: one slice per request batch, never a Python
object per request."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import numpy as np

from ..core.plan import StepResult
from ..core.request import RequestBatch
from ..core.scheduler import Ledger
from ..core.submission import Submission

# (batch, ids of its finished requests) -> (the call, its rows), or None if it was cancelled.
Finish = Callable[[RequestBatch, np.ndarray], "tuple[Submission, np.ndarray] | None"]


def deliver(result: StepResult, ledger: Ledger, finish: Finish) -> None:
    """Write the step's finished vectors and token arrays into their calls' results."""
    for batch, sel in by_batch(ledger.batches, result.vector_ids):
        owner = finish(batch, result.vector_ids[sel])
        if owner is not None:
            submission, rows = owner
            assert result.vectors is not None, "a step with vector ids has their vectors"
            submission.put_vectors(rows, result.vectors[sel])
    for batch, sel in by_batch(ledger.batches, result.token_owner_ids):
        owner = finish(batch, result.token_owner_ids[sel])
        if owner is not None:
            submission, rows = owner
            offsets, token_vectors = result.token_offsets, result.token_vectors
            assert token_vectors is not None, "a step with token owners has their tokens"
            picked = np.arange(len(result.token_owner_ids))[sel].tolist()
            values = [token_vectors[offsets[j] : offsets[j + 1]] for j in picked]
            submission.put_tokens(rows, values)


def by_batch(
    batches: tuple[RequestBatch, ...], ids: np.ndarray
) -> Iterator[tuple[RequestBatch, slice | np.ndarray]]:
    """(batch, where its ids are in ``ids``) for every batch holding some of ``ids``: a slice
    where they lie together (the usual step: outputs come in plan order, and a slice of the
    step's output array is a view, not a copy), else an index array."""
    if not len(ids):
        return
    if len(batches) == 1:
        yield batches[0], slice(0, len(ids))
        return
    firsts = np.array([b.first_id for b in batches])
    which = np.searchsorted(firsts, ids, side="right") - 1
    steps = np.diff(which)
    if (steps >= 0).all():
        edges = [0, *(np.flatnonzero(steps) + 1).tolist(), len(ids)]
        for lo, hi in itertools.pairwise(edges):
            yield batches[int(which[lo])], slice(lo, hi)
        return
    order = np.argsort(which, kind="stable")
    bounds = np.flatnonzero(np.diff(which[order])) + 1
    for group in np.split(order, bounds):
        yield batches[int(which[group[0]])], group
