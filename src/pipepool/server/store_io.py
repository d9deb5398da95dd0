"""The Batch store's I/O discipline (``batch_store.py``): each method's storage faults turned
into ``StoreUnavailable`` and reported on the health board, SQLite transactions that never
stay open on a fault, and whole writes."""

from __future__ import annotations

import functools
import logging
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from .store_faults import HEALTH, fault_of

__all__ = ["Transaction", "checked", "rename_if_there", "write_all"]

log = logging.getLogger("pipepool.server")
_Method = TypeVar("_Method", bound=Callable[..., Any])


def checked(*, writes: str | None) -> Callable[[_Method], _Method]:
    """A store method whose storage faults become ``StoreUnavailable`` and mark the store
    degraded. One that succeeds marks it healthy again when it proves the store writable:
    ``writes="file"`` (it wrote bytes to disk), ``writes="db"`` (when it changed rows: an
    UPDATE that matched none wrote nothing)."""

    def wrap(method: _Method) -> _Method:
        @functools.wraps(method)
        def checked_call(self: Any, *args: Any, **kwargs: Any) -> Any:
            changes = self._db.total_changes if writes == "db" else 0
            try:
                result = method(self, *args, **kwargs)
            except Exception as exc:
                fault = fault_of(exc, self.dir)
                if fault is None:
                    raise
                if HEALTH.failed(self.dir, fault):
                    log.error("the batch store is degraded: %s", fault.reason)
                raise fault from exc
            wrote = writes == "file" or (writes == "db" and self._db.total_changes > changes)
            if wrote and HEALTH.wrote(self.dir):
                log.warning("the batch store writes again: batches go on")
            return result

        return checked_call  # type: ignore[return-value]

    return wrap


class Transaction:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on an exception): the write lock is taken at the
    start, so a transaction never fails half-way on another process's lock. A body that
    commits itself (``delete_file``) leaves nothing to commit."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind, _value, _traceback) -> None:
        if kind is None and self.db.in_transaction:
            try:
                self.db.execute("COMMIT")
                return
            except BaseException:
                self._rollback()
                raise
        self._rollback()

    def _rollback(self) -> None:
        # SQLite may have rolled back already (a full disk can end a transaction by itself).
        if self.db.in_transaction:
            try:
                self.db.execute("ROLLBACK")
            except sqlite3.Error as exc:
                log.warning("a batch store transaction could not be rolled back: %s", exc)


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` at ``fd``, partial writes resumed."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def rename_if_there(source: Path, target: Path) -> bool:
    """``os.replace``; False where ``source`` is not there."""
    try:
        os.replace(source, target)
    except FileNotFoundError:
        return False
    return True
