"""The output and error bodies of a batch in progress: where the exactly-once step happens."""

from __future__ import annotations

import os

from ..jobs.batch_lines import LineResult
from .batch_store import BatchRecord, BatchStore

__all__ = ["BatchOutput"]


class BatchOutput:
    """The output and error bodies of a batch in progress, open for appending (cut to their
    committed lengths first: ``BatchStore.cut_to_committed``). ``write`` appends finished
    lines, then commits them: the exactly-once step. A write that fails (a storage fault)
    leaves the bodies longer than committed: this object is then done with, and the next run
    cuts them back before it appends."""

    def __init__(self, store: BatchStore, record: BatchRecord) -> None:
        self.store, self.batch_id = store, record.id
        self.sizes = [record.out_bytes, record.err_bytes]  # committed, then as written
        self._paths = (store.path(record.out_file), store.path(record.err_file))
        self._fds: list[int] = []

    def __enter__(self) -> BatchOutput:
        for path in self._paths:
            # Unbuffered: a failed write leaves nothing in a buffer for a later flush to put
            # after lines written since (the sizes committed would not say where they end).
            self._fds.append(self.store.opened(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT))
        return self

    def __exit__(self, *_exc) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def write(self, results: list[LineResult]) -> None:
        if not results:
            return
        for index, fd in enumerate(self._fds):
            data = b"".join(r.text for r in results if r.ok == (index == 0))
            if data:
                # In the kernel's hands once written: a killed process loses none of it.
                self.store.append(fd, data)
                self.sizes[index] += len(data)
        completed = sum(r.ok for r in results)
        self.store.record(
            self.batch_id,
            [r.line for r in results],
            completed=completed,
            failed=len(results) - completed,
            sizes=(self.sizes[0], self.sizes[1]),
            tokens=sum(r.tokens for r in results),
        )
