"""Which call each request batch's results go to, and which of its rows are done.

The engine's loop thread finishes rows as steps return them; calling threads add batches (under
the engine's lock). After a pipeline failure every unfinished row is queued again: each run of
consecutive unfinished rows of a batch becomes a batch of its own, under new request ids
(stages of a new pipeline know no old id), owned by the same call at the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.request import RequestBatch
from ..core.submission import Submission


@dataclass(eq=False)
class Owner:
    """The call a batch's results go to: its rows ``row0 ..``, or ``rows`` (the call's row of
    each batch row) where the batch holds them in another order; which of them are ``done``."""

    submission: Submission
    row0: int
    batch: RequestBatch
    rows: np.ndarray | None = None

    def call_rows(self, batch_rows: np.ndarray) -> np.ndarray:
        return self.row0 + batch_rows if self.rows is None else self.rows[batch_rows]

    def __post_init__(self) -> None:
        self.done = np.zeros(len(self.batch), dtype=bool)
        self.remaining = len(self.batch)


class Owners:
    """Which call (``Submission``) and which of its rows each enqueued request batch
    belongs to, so step results can be written into the right call and a restarted
    pipeline (or a lost replica) can run the unfinished rows again (``requeue``). Callers
    hold the owning engine's lock."""

    def __init__(self) -> None:
        self._by_first: dict[int, Owner] = {}  # batch first id -> its owner

    def add(
        self,
        submission: Submission,
        row0: int,
        batch: RequestBatch,
        rows: np.ndarray | None = None,
    ) -> None:
        self._by_first[batch.first_id] = Owner(submission, row0, batch, rows)

    def get(self, first_id: int) -> Owner | None:
        return self._by_first.get(first_id)

    def first_ids(self) -> list[int]:
        return list(self._by_first)

    def pop(self, first_id: int) -> Owner | None:
        return self._by_first.pop(first_id, None)

    def finish(self, batch: RequestBatch, ids: np.ndarray) -> tuple[Submission, np.ndarray] | None:
        """(call, its rows) for finished requests ``ids`` of a batch; None if the call was
        cancelled."""
        owner = self._by_first.get(batch.first_id)
        if owner is None:
            return None
        rows = ids - batch.first_id
        owner.done[rows] = True
        owner.remaining -= len(rows)
        if owner.remaining == 0:
            del self._by_first[batch.first_id]
        return owner.submission, owner.call_rows(rows)

    def take_all(self) -> list[Owner]:
        """Every owner, forgotten here (their calls are about to fail)."""
        owners, self._by_first = list(self._by_first.values()), {}
        return owners

    def requeue(self, next_id: int) -> tuple[list[RequestBatch], int]:
        """Every unfinished row again, as new batches with ids from ``next_id``, in the order
        the calls came; returns them and the next free id. Each call learns its new batches
        (``Submission.batches``: cancelling it aborts them)."""
        batches: list[RequestBatch] = []
        by_first: dict[int, Owner] = {}
        for first_id in sorted(self._by_first):
            owner = self._by_first[first_id]
            for lo, hi in unfinished_runs(owner.done):
                part = owner.batch.rows(next_id, lo, hi)
                next_id += len(part)
                owner.submission.batches.append(part)
                rows = None if owner.rows is None else owner.rows[lo:hi]
                by_first[part.first_id] = Owner(owner.submission, owner.row0 + lo, part, rows)
                batches.append(part)
        self._by_first = by_first
        return batches, next_id

    @property
    def num_unfinished(self) -> int:
        return sum(o.remaining for o in list(self._by_first.values()))


def unfinished_runs(done: np.ndarray) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each run of consecutive False in ``done``."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], (~done).astype(np.int8), [0]])))
    return [(int(lo), int(hi)) for lo, hi in edges.reshape(-1, 2)]
