"""A replica's works queued as calls: one frame's consecutive works of one client, with the
same parameters, go to the engine as one call, and their results go back work by work.

A front end under many one-text requests sends frames of one-prompt works. Queued one call
each, every work would cost the replica's reader a call's future and queue entry, and its
engine loop a batch at every step's scan (~100 us a work on a CPU core, against ~10 us a
prompt of one large call: ``benchmarks/one_text_engine.py --frame``). Works of one client
already take one turn in the scheduler (``core.priority.client_turns``: the server keys turns
by the client's address), so one call of them is scheduled as they were; a group stays within
``max_tokens`` (the pipeline's light-call bound, ``LocalPipeline.light_tokens``), so works
that were light calls stay one. Works without a client (each its own turn), pair inputs, key
lengths and images are queued alone, as sent.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .messages import Result, Work

_ROW0 = np.zeros(1, dtype=np.int64)  # row 0 of a work: the rows of every one-prompt result
_ROW0.flags.writeable = False


def _joinable(work: Work) -> bool:
    """Whether ``work`` may share a call with others (of the same key, ``_key``)."""
    return (
        work.client is not None
        and work.type_ids is None
        and work.key_lens is None
        and work.media is None
        and work.images is None
    )


def _key(work: Work) -> tuple:
    return (work.params, work.background, work.client)


class WorkGroup:
    """Works queued as one call: their prompts back to back in the works' order
    (``token_ids``, ``lengths``); the call's row ``r`` is row ``r - starts[k]`` of work ``k``.
    ``drop(first_id)`` stops a work's results (aborted at the front end); ``results`` turns a
    step's finished rows of the call into one ``Result`` per work still wanted."""

    def __init__(self, works: list[Work]) -> None:
        assert works, "a group holds a work"
        first = works[0]
        self.params = first.params
        self.background = first.background
        self.client = first.client
        self.first_ids = [w.first_id for w in works]
        self.starts = np.zeros(len(works) + 1, dtype=np.int64)
        np.cumsum([len(w.lengths) for w in works], out=self.starts[1:])
        self._singles = len(self) == len(works)
        self._dropped = [False] * len(works)
        self._live = len(works)
        if len(works) == 1:
            self.token_ids, self.lengths = first.token_ids, first.lengths
            self.type_ids, self.key_lens = first.type_ids, first.key_lens
            self.media, self.images = first.media, first.images
        else:
            self.token_ids = np.concatenate([w.token_ids for w in works])
            self.lengths = np.concatenate([w.lengths for w in works])
            self.type_ids = self.key_lens = self.media = None
            self.images = None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def drop(self, first_id: int) -> bool:
        """Send no more results of work ``first_id``; true once no work of the group is
        wanted (the call may be cancelled)."""
        k = self.first_ids.index(first_id)
        if not self._dropped[k]:
            self._dropped[k] = True
            self._live -= 1
        return self._live == 0

    def results(self, rows: np.ndarray, values: np.ndarray | list, replica_s: float) -> list:
        """One ``Result`` per wanted work among the call's finished ``rows`` (any order)."""
        if len(self.first_ids) == 1:
            return [] if self._dropped[0] else [Result(self.first_ids[0], rows, values, replica_s)]
        if self._singles:  # one prompt a work (one-text requests): row k is work k's
            dropped, ids = self._dropped, self.first_ids
            return [
                Result(ids[k], _ROW0, values[i : i + 1], replica_s)
                for i, k in enumerate(rows.tolist())
                if not dropped[k]
            ]
        part = np.searchsorted(self.starts, rows, side="right") - 1
        order = np.argsort(part, kind="stable")
        cuts = np.flatnonzero(np.diff(part[order])) + 1
        out = []
        for idx in np.split(order, cuts):
            k = int(part[idx[0]])
            if self._dropped[k]:
                continue
            mine = (
                values[idx] if isinstance(values, np.ndarray) else [values[i] for i in idx.tolist()]
            )
            out.append(Result(self.first_ids[k], rows[idx] - self.starts[k], mine, replica_s))
        return out


def group_works(works: list[Work], max_tokens: int) -> Iterator[WorkGroup]:
    """``works`` (consecutive in one frame) as groups, in order: each run of joinable works of
    one key whose tokens stay within ``max_tokens`` is one group; any other work a group of
    its own."""
    run: list[Work] = []
    tokens = 0
    for work in works:
        size = len(work.token_ids)
        if run and _joinable(work) and _key(work) == _key(run[0]) and tokens + size <= max_tokens:
            run.append(work)
            tokens += size
            continue
        if run:
            yield WorkGroup(run)
        run, tokens = [work], size
        if not _joinable(work) or size > max_tokens:
            yield WorkGroup(run)
            run, tokens = [], 0
    if run:
        yield WorkGroup(run)
