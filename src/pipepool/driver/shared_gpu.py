"""Models of one server sharing a GPU: a model's steps stay short while another has work.

Each model's pipelines run in processes of their own, and a GPU runs one process's kernels at a
time. A request to a small model therefore waits behind whatever its neighbour has queued on
the GPU: with a flooded reranker's 16,384-token steps (~25 ms each on an H200, two in flight),
that is the small model's tail. While a neighbour has had work within ``_ACTIVE_S``, a pipeline
caps its steps at ``EngineConfig.shared_gpu_step_tokens``; alone on its GPUs it keeps its whole
budget, so a model beside idle ones runs as fast as alone (BENCHMARKS.md, issue 35).

The models talk through a board: a file of one int64 per model, mapped by every pipeline's
process, holding when that model's pipeline last had work (``CLOCK_MONOTONIC`` nanoseconds,
one clock for every process of the host). A write is one aligned 8-byte store; a reader sees
each slot whole, so no lock is needed.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Sequence

import numpy as np

from ..config import GpuNeighbours

# How recently a neighbour must have had work for this model's steps to stay short: longer
# than the gaps of a steady stream of small requests (a client sending one after another),
# short enough that a model whose neighbours went quiet gets its whole budget back at once.
_ACTIVE_S = 0.2
_SLOT = np.dtype(np.int64)


def plan_neighbours(devices: Sequence[Sequence[str]]) -> list[tuple[int, ...]]:
    """Model i's neighbours from every model's devices (its pipelines' stages: ``cuda:N`` or
    ``cpu``): the other models with a stage on one of its GPUs. The CPU's cores are not taken
    in turns, so models there are nobody's neighbours."""
    gpus = [{d for d in stages if d.startswith("cuda")} for stages in devices]
    return [
        tuple(j for j, theirs in enumerate(gpus) if j != i and mine & theirs)
        for i, mine in enumerate(gpus)
    ]


def create_board(path: str, num_models: int) -> None:
    """The board's file for ``num_models`` models, every slot 0 (no work yet)."""
    with open(path, "wb") as f:
        f.write(bytes(_SLOT.itemsize * num_models))


class SharedGpu:
    """One pipeline's view of the board: ``had_work`` stamps its model's slot, ``step_cap``
    says the budget of its next step (None: the whole budget). Safe from any thread."""

    def __init__(self, where: GpuNeighbours, step_tokens: int, active_s: float = _ACTIVE_S):
        self.step_tokens = step_tokens
        self._slot = where.slot
        self._neighbours = list(where.neighbours)
        self._active_ns = int(active_s * 1e9)
        fd = os.open(where.board, os.O_RDWR)
        try:
            # MAP_SHARED: every process sees every store. Unmapped with this object (the loop
            # thread may still read it after its pipeline closed).
            self._map = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self._slots = np.frombuffer(self._map, dtype=_SLOT)
        if not max([*self._neighbours, self._slot]) < len(self._slots):
            raise ValueError(f"{where.board} holds {len(self._slots)} slots: {where}")

    @classmethod
    def open(cls, where: GpuNeighbours | None, step_tokens: int) -> SharedGpu | None:
        """None where there is nothing to share: no neighbour, or no cap asked for (0)."""
        if where is None or step_tokens <= 0:
            return None
        return cls(where, step_tokens)

    def had_work(self) -> None:
        """This model's pipeline has work now (queued or on its devices)."""
        self._slots[self._slot] = time.monotonic_ns()

    def neighbour_active(self) -> bool:
        """Whether another model on one of these GPUs had work within the window."""
        since = time.monotonic_ns() - self._active_ns
        return bool((self._slots[self._neighbours] > since).any())

    def step_cap(self) -> int | None:
        """The next step's token budget: ``step_tokens`` while a neighbour is active, else
        None (the pipeline's own budget)."""
        return self.step_tokens if self.neighbour_active() else None
