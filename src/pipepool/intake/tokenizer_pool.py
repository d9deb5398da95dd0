"""A model's tokenizer in several processes of its own: a large batch split between them.

In the engine's process, tokenising holds the interpreter's lock for part of every text (the
Rust encodings become Python objects, their ids one array), and the Rust tokenizer's pool
takes the cores the engine's own threads need. On a host with cores to spare (a GPU host), each
helper process (``tokenizer_process.TokenizerProcess``, one encoding thread each) tokenises a
chunk of the batch; only the texts and the finished arrays cross to the engine's process, about
a third of a microsecond of its time a text where tokenising it here costs tens
(docs/benchmarks/served.md, "Tokenising beside the engine").
"""

from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ..runtime.cores import usable_cpus
from .tokenizer_process import TokenizerProcess

# Texts of a chunk, at least: a chunk's round trip costs ~100 us of the helper's and the
# engine's time, a short text ~20-50 us of tokenising.
MIN_CHUNK = 32
# Cores left to the engine's process by the automatic size (``pool_size``): its loop thread and
# the device's host thread.
_ENGINE_CORES = 2
# Hosts with fewer cores than this tokenise in the engine's process by default: a pool would
# take the cores the engine's own threads need.
_MIN_CORES = 8


def pool_size(wanted: int | None, cuda: bool, cores: int | None = None) -> int:
    """Helper processes of an engine: ``wanted`` where given (0: none); by default, on a CUDA
    engine with at least ``_MIN_CORES`` cores (those this process may run on, or ``cores``),
    every core but ``_ENGINE_CORES``; else none (the CPU's cores compute the model)."""
    if wanted is not None:
        return wanted
    if cores is None:
        cores = usable_cpus()
    return cores - _ENGINE_CORES if cuda and cores >= _MIN_CORES else 0


class TokenizerPool:
    """A ``tokenizer.BatchHelper`` of ``processes`` helper processes, each holding
    ``tokenizer_file`` and encoding on one thread. ``encode_flat`` and ``encode_pairs`` split
    their batch into chunks (``MIN_CHUNK`` texts at least, one per process where the batch is
    large enough), which the processes take as they come free, and join the answers in order:
    the same arrays as one process's call. Other methods run whole in one process. Calls from
    several threads share the processes; a chunk a process could not answer raises
    ``HelperLost`` for the call (the caller then tokenises it itself; the process is started
    again for the next chunk). ``close`` stops them all."""

    def __init__(self, tokenizer_file: Path, processes: int) -> None:
        if processes < 1:
            raise ValueError("a tokenizer pool needs at least one process")
        self.processes = processes
        self._idle: queue.SimpleQueue[TokenizerProcess] = queue.SimpleQueue()
        self._helpers: list[TokenizerProcess] = []
        try:
            for _ in range(processes):
                helper = TokenizerProcess(tokenizer_file, threads=1)
                self._helpers.append(helper)
                self._idle.put(helper)
        except BaseException:
            self.close()
            raise
        self._threads = ThreadPoolExecutor(processes, thread_name_prefix="pipepool-tokenizer")

    @property
    def pids(self) -> list[int | None]:
        return [h.pid for h in self._helpers]

    def run(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``Tokenizer.<method>(*args, **kwargs)``'s result, computed in the processes."""
        if method == "encode_flat":
            (texts,) = args
            parts = self._chunked(method, [texts], kwargs)
            flats, lengths = zip(*parts, strict=True)
            return np.concatenate(flats), np.concatenate(lengths)
        if method == "encode_pairs":
            firsts, seconds = args
            parts = self._chunked(method, [firsts, seconds], kwargs)
            ids, types, lengths = zip(*parts, strict=True)
            return np.concatenate(ids), np.concatenate(types), np.concatenate(lengths)
        return self._in_one(method, *args, **kwargs)

    def _chunked(self, method: str, columns: list[list], kwargs: dict) -> list:
        """``method`` on consecutive chunks of ``columns`` (lists of one length), in order."""
        n = len(columns[0])
        size = max(MIN_CHUNK, -(-n // self.processes))
        if size >= n:
            return [self._in_one(method, *columns, **kwargs)]
        futures = [
            self._threads.submit(self._in_one, method, *(c[lo : lo + size] for c in columns),
                                 **kwargs)
            for lo in range(0, n, size)
        ]  # fmt: skip
        return [f.result() for f in futures]

    def _in_one(self, method: str, *args: Any, **kwargs: Any) -> Any:
        helper = self._idle.get()
        try:
            return helper.run(method, *args, **kwargs)
        finally:
            self._idle.put(helper)

    def close(self) -> None:
        threads = getattr(self, "_threads", None)
        if threads is not None:
            threads.shutdown(wait=False, cancel_futures=True)
        for helper in self._helpers:
            helper.close()
