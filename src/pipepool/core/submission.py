"""The future of one ``Engine.submit`` call, filled in step by step by the engine loop."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from .request import PoolingParams

# ``Submission``'s ``on_result(rows, values)``: a step's finished rows and their outputs.
ResultCallback = Callable[[np.ndarray, np.ndarray | list], None]


class Submission(Future):
    """Results of one call, in input order: an ``[n, D]`` float32 array for one vector per
    input (LAST, MEAN, CLS), or a list of ``[len, H]`` float32 arrays (ALL).

    Steps write finished rows straight into the result (no per-request objects);
    ``num_done`` counts them and ``add_progress_callback`` hears about every step that
    finished some. ``on_result(rows, values)`` hears each step's finished rows and their
    outputs (an array of vectors, or a list of token arrays) before they count as done, on the
    engine's loop thread: a replica forwards them to the front end this way. It is given at
    construction, so no step can finish rows before it is there. ``cancel()`` aborts whatever
    has not finished: the engine frees it.
    ``num_tokens`` is each input's prompt length after truncation (usage reports).
    ``background``: batch-job work, queued below online calls; ``client``: whose turns it
    takes (``core.priority``). ``remote_s``: where another process computes the call (a
    replica), the seconds its last outputs spent there; None where this process computes it.
    """

    def __init__(
        self,
        params: PoolingParams,
        num_inputs: int,
        width: int,
        on_cancel: Callable[[Submission], None],
        *,
        background: bool = False,
        client: str | None = None,
        on_result: ResultCallback | None = None,
    ) -> None:
        super().__init__()
        self.params = params
        self.background = background
        self.client = client
        self.num_inputs = num_inputs
        self.num_done = 0
        self.num_tokens = np.zeros(num_inputs, dtype=np.int64)
        self.batches: list = []  # the RequestBatches enqueued for it
        self.remote_s: float | None = None
        self._outputs: np.ndarray | list = (
            np.empty((num_inputs, width), dtype=np.float32)
            if params.code.is_vector
            else [None] * num_inputs
        )
        self._on_cancel = on_cancel
        self._progress: list[Callable[[int], None]] = []
        self._on_result = on_result
        self._lock = threading.Lock()
        if num_inputs == 0:  # nothing to wait for
            self.set_result(self._outputs)

    def add_progress_callback(self, fn: Callable[[int], None]) -> None:
        """``fn(n)`` after each step that finished ``n`` more of this call's inputs (called on
        the engine's loop thread: keep it short)."""
        self._progress.append(fn)

    def cancel(self) -> bool:
        with self._lock:
            if self.done():
                return False
            cancelled = super().cancel()
        if cancelled:
            self._on_cancel(self)
        return cancelled

    # -- filled in by the engine loop ----------------------------------------------------------

    def put_vectors(self, rows: np.ndarray, vectors: np.ndarray) -> None:
        """Rows ``rows`` (input indices) finished with these vectors (already cut to the
        requested dimensions on the device, or zero-padded past them: cut here). ``vectors``
        is copied: it may be a view of a buffer the engine reuses."""
        outputs = self._outputs
        assert isinstance(outputs, np.ndarray), "vectors come only for one-vector poolings"
        values = vectors[:, : outputs.shape[1]]
        n = len(rows)
        written: slice | np.ndarray
        if n == 1 or (n and bool((np.diff(rows) == 1).all())):  # consecutive: a slice
            written = slice(int(rows[0]), int(rows[0]) + n)
        else:
            written = rows
        outputs[written] = values
        if self._on_result is not None:  # ours, not ``vectors``: that may be a pinned buffer
            self._on_result(rows, outputs[written])
        self._count(n)

    def put_tokens(self, rows: np.ndarray, values: list[np.ndarray]) -> None:
        width = self.params.dimensions
        if width:
            values = [value[:, :width] for value in values]
        for row, value in zip(rows.tolist(), values, strict=True):
            self._outputs[row] = value
        if self._on_result is not None:
            self._on_result(rows, values)
        self._count(len(rows))

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if not self.done():
                self.set_exception(exc)

    def _count(self, n: int) -> None:
        self.num_done += n
        for fn in self._progress:
            fn(n)
        if self.num_done == self.num_inputs:
            with self._lock:
                if not self.done():
                    self.set_result(self._outputs)
