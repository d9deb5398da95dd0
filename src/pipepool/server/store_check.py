"""The Batch store's check at a server's start, and what a crash may leave to finish.

``open_checked`` refuses (``StoreDamagedError``, naming the file and the recovery command) a
state directory whose records cannot be trusted, rather than serving an empty or partial
store beside the bodies of the records it lost:

- the database file is missing, or empty (0 bytes), while file bodies are on disk;
- SQLite cannot read it (garbage over its header), or ``PRAGMA quick_check`` finds damage;
- a body under ``files/`` belongs to no record: records were lost (a ``-wal`` file deleted or
  left behind by a copy, an older or replaced database).

A checkpoint (at a clean close, or by any SQLite tool that opens the database) keeps every
record, so only a real loss is told.

What a crash leaves between two steps of an upload or a deletion (``batch_store.py``) is
finished instead: an upload committed but not renamed into place is moved there, a deletion
not committed is undone, leftovers of uncommitted steps are removed.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import PipepoolError
from .batch_records import DB_NAME
from .batch_store import BatchStore

__all__ = ["StoreDamagedError", "StoreProblem", "find_problems", "known_bodies", "open_checked"]

log = logging.getLogger("pipepool.server")
_SHOWN = 3  # bodies named in a message
# A leftover changed this recently may be another server's step in progress (two servers may
# share a directory): left alone.
_SETTLED_S = 300


class StoreDamagedError(PipepoolError):
    """A store that a server must not serve as it is; the message says what is wrong with
    which file, and how to recover."""


@dataclass(frozen=True)
class StoreProblem:
    """What is wrong with a state directory's store: the file and why."""

    path: Path
    why: str

    def error(self) -> StoreDamagedError:
        state_dir = self.path.parent
        return StoreDamagedError(
            f"the batch store {self.path} cannot be served: {self.why}. Nothing was changed. "
            f"To recover, stop every server using {state_dir}, then either restore a backup "
            "(made by `pipepool batch-store backup`: a state directory to start from as it "
            f"is), or run `pipepool batch-store recover --state-dir {state_dir}`, which "
            "moves the damaged database and the bodies it does not know into "
            f"{state_dir}/damaged-<time>/ and starts a store with every record it can still "
            f"read (or move {state_dir} aside to start empty)"
        )


def find_problems(state_dir: Path) -> list[StoreProblem]:
    """What makes the store of ``state_dir`` unfit to serve (empty: fit, or no store yet).
    Reads only."""
    state_dir = Path(state_dir)
    db, wal = state_dir / DB_NAME, state_dir / f"{DB_NAME}-wal"
    bodies = _bodies(state_dir)
    had_wal = wal.exists()  # before SQLite opens the database, which makes one
    if not db.exists():
        if bodies:
            return [StoreProblem(db, f"it is missing, yet {_some(bodies)} are on disk")]
        return []
    if db.stat().st_size == 0:
        if bodies or (had_wal and wal.stat().st_size > 0):
            return [StoreProblem(db, f"it is empty (0 bytes), yet {_some(bodies)} are on disk")]
        return []
    try:
        con = sqlite3.connect(f"file:{db}?mode=rw", uri=True, isolation_level=None)
    except sqlite3.Error as exc:
        return [StoreProblem(db, f"SQLite cannot open it: {exc}")]
    try:
        found = [row[0] for row in con.execute("PRAGMA quick_check(5)")]
        if found != ["ok"]:
            return [StoreProblem(db, f"PRAGMA quick_check finds damage: {'; '.join(found)}")]
        # Read after the listing, then each candidate looked at again: a server sharing the
        # directory may be committing an upload or a deletion meanwhile.
        files = state_dir / "files"
        candidates = set(bodies) - known_bodies(con)
        orphans = sorted(b for b in candidates - known_bodies(con) if (files / b).exists())
        if orphans:
            return [StoreProblem(db, f"it has no record of {_some(orphans)} in "
                                 f"{state_dir / 'files'}: it lost records (a deleted or "
                                 "older -wal file, or a replaced database)")]  # fmt: skip
    except sqlite3.DatabaseError as exc:
        return [StoreProblem(db, f"SQLite cannot read it: {exc}")]
    finally:
        con.close()
    return []


def open_checked(state_dir: Path, *, settled_s: float = _SETTLED_S) -> BatchStore | None:
    """At a server's start: the store of ``state_dir`` checked (``StoreDamagedError`` if it
    must not be served) and what a crash left finished; the store, held open until
    ``close_open_stores``. None where there is no store yet (one is made when a route first
    needs it)."""
    problems = find_problems(state_dir)
    if problems:
        raise problems[0].error()
    if not BatchStore.exists(state_dir):
        return None
    store = BatchStore(state_dir)
    _finish_leftovers(store, settled_s)
    return store


def known_bodies(con: sqlite3.Connection) -> set[str]:
    """The body names a database has records of: its files, and its batches' output and error
    bodies (named when a batch is created)."""
    tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    known: set[str] = set()
    if "files" in tables:
        known.update(row[0] for row in con.execute("SELECT id FROM files"))
    if "batches" in tables:
        for out_file, err_file in con.execute("SELECT out_file, err_file FROM batches"):
            known.update((out_file, err_file))
    return known


def _finish_leftovers(store: BatchStore, settled_s: float) -> None:
    """Finish or undo what a crash left between two steps of an upload or a deletion (those
    changed in the last ``settled_s`` seconds may be another server's, in progress)."""
    with sqlite3.connect(store.dir / DB_NAME) as con:
        files = {row[0] for row in con.execute("SELECT id FROM files")}
    for leftover in sorted(store.files_dir.glob(".*")):
        name = leftover.name
        try:
            if time.time() - leftover.stat().st_ctime < settled_s:
                continue
        except FileNotFoundError:
            continue
        file_id = name[1:].rsplit(".", 1)[0]
        body = store.files_dir / file_id
        if name.endswith((".part", ".deleted")) and file_id in files and not body.exists():
            try:
                os.replace(leftover, body)  # committed upload, or a deletion never committed
            except FileNotFoundError:
                continue
            log.warning("batch store: %s restored from %s (a crash between two steps)",
                        file_id, name)  # fmt: skip
        else:
            leftover.unlink(missing_ok=True)


def _bodies(state_dir: Path) -> list[str]:
    files = state_dir / "files"
    if not files.is_dir():
        return []
    return sorted(p.name for p in files.iterdir() if p.name.startswith("file-"))


def _some(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return f"{len(names)} file bodies ({shown}{more})"
