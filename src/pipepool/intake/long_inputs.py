"""Inputs longer than ``max_model_len`` with ``long_inputs="chunk"``: each is split into windows
of at most ``max_model_len`` tokens, every window is embedded as a request of its own, and the
window vectors are combined as vLLM's chunked processing does: the mean of the windows' pooled
vectors weighted by their token counts, then the Matryoshka cut and the model's normalisation
(token embeddings: the windows' tokens back to back).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

import numpy as np

from ..core.request import PoolingParams
from ..core.submission import Submission


@dataclass(frozen=True)
class Windows:
    """Prompts cut into windows, back to back; ``owner[k]`` is the input window k belongs to."""

    token_ids: np.ndarray  # [total tokens] int64, unchanged order
    lengths: np.ndarray  # [num windows] int64, each <= the window size
    owner: np.ndarray  # [num windows] int64, ascending
    input_tokens: np.ndarray  # [num inputs] int64: tokens of each input (all windows)

    @property
    def num_inputs(self) -> int:
        return len(self.input_tokens)


def split_windows(token_ids: np.ndarray, lengths: np.ndarray, size: int) -> Windows:
    """Consecutive windows of ``size`` tokens (the last one of an input may be shorter), as
    vLLM cuts them: by token position alone, so only the first window keeps a leading special
    token and only the last a trailing one."""
    per_input = -(-lengths // size)  # windows per input
    owner = np.repeat(np.arange(len(lengths), dtype=np.int64), per_input)
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(per_input[:-1], out=starts[1:])
    k = np.arange(len(owner), dtype=np.int64) - starts[owner]  # window number within its input
    window_lengths = np.minimum(size, lengths[owner] - k * size)
    return Windows(token_ids, window_lengths, owner, np.asarray(lengths, dtype=np.int64))


def window_params(params: PoolingParams) -> PoolingParams:
    """What each window is computed with: raw pooled vectors (combined, cut and normalised
    afterwards); token embeddings need nothing after concatenation."""
    if not params.code.is_vector:
        return params
    return PoolingParams(pooling=params.pooling, normalize=False, dimensions=None)


def combine(windows: Windows, outputs, params: PoolingParams):
    """Per-input results from per-window ones (see the module docstring)."""
    if not params.code.is_vector:
        bounds = np.flatnonzero(np.diff(windows.owner)) + 1
        groups = np.split(np.arange(len(outputs)), bounds)
        return [np.concatenate([outputs[k] for k in group]) for group in groups]
    weights = windows.lengths.astype(np.float64)[:, None]
    sums = np.zeros((windows.num_inputs, outputs.shape[1]), dtype=np.float64)
    np.add.at(sums, windows.owner, outputs.astype(np.float64) * weights)
    mean = sums / windows.input_tokens[:, None]
    if params.dimensions:
        mean = mean[:, : params.dimensions]
    if params.normalize:  # as torch's F.normalize(eps=1e-12) on the device
        mean /= np.maximum(np.linalg.norm(mean, axis=1, keepdims=True), 1e-12)
    return mean.astype(np.float32)


class CombinedSubmission(Future):
    """The future of a call whose inputs were split into windows: behaves as a ``Submission``
    of the inputs (``num_inputs``, ``num_done``, ``num_tokens``, progress callbacks,
    ``cancel``) over the ``Submission`` of the windows."""

    def __init__(self, inner: Submission, windows: Windows, params: PoolingParams) -> None:
        super().__init__()
        self.inner = inner
        self.windows = windows
        self.params = params
        self.num_inputs = windows.num_inputs
        self.num_tokens = windows.input_tokens
        self.batches = inner.batches
        inner.add_done_callback(self._finish)

    @property
    def num_done(self) -> int:
        """Inputs finished, estimated from the windows finished until the last one is."""
        if self.done():
            return self.num_inputs
        return self.inner.num_done * self.num_inputs // len(self.windows.lengths)

    @property
    def remote_s(self) -> float | None:
        """``Submission.remote_s`` of the windows' call."""
        return self.inner.remote_s

    def add_progress_callback(self, fn: Callable[[int], None]) -> None:
        self.inner.add_progress_callback(fn)

    def cancel(self) -> bool:
        if not self.inner.cancel():
            return False
        return super().cancel()

    def _finish(self, inner: Future) -> None:
        if inner.cancelled():
            super().cancel()
            return
        exc = inner.exception()
        with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
            if exc is not None:
                self.set_exception(exc)
            else:
                self.set_result(combine(self.windows, inner.result(), self.params))
