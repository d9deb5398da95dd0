"""Lanes: a CPU step's tiles computed side by side, each on a thread of its own.

With N intra-op threads every op of a tile is split N ways, and the threads meet at a barrier
after each op: an encoder layer on short requests is some forty ops (a GEMM per projection, an
attention call per run of equal lengths, norms), each too small to keep N cores busy between
barriers, and any core taken away for a moment by another process stalls every op. A tile
depends on no other tile (``cpu_tiles``), so instead N lanes each run whole tiles on one
intra-op thread, the lanes releasing the GIL inside every op.

Thread counts in PyTorch are per thread for OpenMP and MKL (``torch.set_num_threads`` sets the
calling thread's, and a process-wide default that threads pick up on their first op), so a
lane sets its own to one on start, and the default is put back once every lane has started.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")

# Fewer tokens than this per lane and a step runs as one tile on the caller's thread (all of
# its intra-op threads): a lane of a few dozen rows leaves its core waiting on Python.
MIN_LANE_TOKENS = 256


class CpuLanes:
    """``size`` daemon threads, each computing torch ops on one intra-op thread.

    ``map(fn, items)`` runs ``fn`` on every item, at most ``size`` at a time, under the
    caller's grad / inference mode, and returns the results in order (the first exception
    raised, once every item is done). Calls from several threads (engines of one process)
    share the lanes, items taken first come first; ``fn`` must not call ``map``. Not for use
    across ``fork``."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        default = torch.get_num_threads()
        started = threading.Barrier(size + 1)
        for i in range(size):
            threading.Thread(
                target=self._lane, args=(started,), name=f"pipepool-cpu-lane-{i}", daemon=True
            ).start()
        started.wait()
        torch.set_num_threads(default)  # the lanes changed the process's default: put it back

    def _lane(self, started: threading.Barrier) -> None:
        torch.get_num_threads()  # this thread's first op would reset its count to the default
        torch.set_num_threads(1)
        started.wait()
        while True:
            fn, item, inference, grad, future = self._jobs.get()
            try:
                with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                    future.set_result(fn(item))
            except BaseException as exc:  # handed to the caller
                future.set_exception(exc)

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
        futures: list[Future] = []
        for item in items:
            futures.append(Future())
            self._jobs.put((fn, item, inference, grad, futures[-1]))
        for future in futures:
            future.exception()  # wait for all: no lane may still write when we return
        return [future.result() for future in futures]


_pools: dict[tuple[int, int], CpuLanes] = {}
_pools_lock = threading.Lock()


def lanes_here() -> CpuLanes | None:
    """This process's lanes, one per intra-op thread of the calling thread (None for one)."""
    size = torch.get_num_threads()
    if size < 2:
        return None
    key = (os.getpid(), size)  # a forked child has none of its parent's threads
    with _pools_lock:
        if key not in _pools:
            _pools[key] = CpuLanes(size)
        return _pools[key]


def run_tiles(fn: Callable[[T], object], tiles: Sequence[T], lanes: CpuLanes | None) -> None:
    """``fn(tile)`` for every tile: side by side on ``lanes`` where there are two or more
    tiles, else on this thread."""
    if lanes is None or len(tiles) < 2:
        for tile in tiles:
            fn(tile)
    else:
        lanes.map(fn, tiles)
