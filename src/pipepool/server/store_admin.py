"""Backing up and recovering a Batch store (``pipepool batch-store``).

``backup`` copies a store while servers use it: the records through SQLite's online backup API
(a consistent snapshot, whatever is being written), then the bodies those records name. The
copy is a state directory a server starts from as it is (``--state-dir``); a batch running at
the snapshot resumes there from its last committed line.

``recover`` turns a store that ``store_check.py`` refuses into one a server can serve: the
damaged database and the bodies no record names are moved into ``damaged-<time>/`` (nothing is
deleted), and a new database holds every record still readable from the old one.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidInputError
from .batch_records import DB_NAME
from .batch_store import BatchStore
from .store_check import known_bodies

__all__ = ["Recovery", "backup", "recover"]

log = logging.getLogger("pipepool.server")
_TABLES = ("files", "batches", "batch_lines_done")  # copied by recover, in this order


def backup(state_dir: Path, dest: Path) -> int:
    """Copy the store of ``state_dir`` to ``dest`` (a new or empty directory); the number of
    bodies copied."""
    state_dir, dest = Path(state_dir), Path(dest)
    if not BatchStore.exists(state_dir):
        raise InvalidInputError(f"{state_dir} holds no batch store ({DB_NAME})", param="state_dir")
    if dest.exists() and any(dest.iterdir()):
        raise InvalidInputError(f"{dest} is not empty: back up into a new directory", param="dest")
    (dest / "files").mkdir(parents=True, exist_ok=True)
    source = sqlite3.connect(state_dir / DB_NAME, timeout=30)
    copy = sqlite3.connect(dest / DB_NAME)
    try:
        source.backup(copy)
        names = known_bodies(copy)
    finally:
        source.close()
        copy.close()
    copied = 0
    for name in sorted(names):
        try:
            shutil.copyfile(state_dir / "files" / name, dest / "files" / name)
            copied += 1
        except FileNotFoundError:
            pass  # deleted since the snapshot, or an output body not written yet
    return copied


@dataclass(frozen=True)
class Recovery:
    """What ``recover`` did: where the damaged files went, and how many records and bodies
    the new store kept."""

    aside: Path
    records: dict[str, int]  # table -> rows copied into the new database
    unreadable: dict[str, str]  # table -> why its rows could not all be read
    bodies_set_aside: int


def recover(state_dir: Path) -> Recovery:
    """Rebuild the store of ``state_dir`` from what can be read of it (see the module)."""
    state_dir = Path(state_dir)
    aside = state_dir / time.strftime("damaged-%Y%m%dT%H%M%S", time.gmtime())
    aside.mkdir(parents=True)
    for suffix in ("", "-wal", "-shm"):
        path = state_dir / f"{DB_NAME}{suffix}"
        if path.exists():
            os.replace(path, aside / path.name)
    store = BatchStore(state_dir)  # a new, empty database
    store.close()
    new = sqlite3.connect(state_dir / DB_NAME, isolation_level=None)
    records: dict[str, int] = {}
    unreadable: dict[str, str] = {}
    try:
        if (aside / DB_NAME).exists():
            _copy_rows(aside / DB_NAME, new, records, unreadable)
        kept = known_bodies(new)
        moved = 0
        for body in sorted((state_dir / "files").glob("file-*")):
            if body.name not in kept:
                (aside / "files").mkdir(exist_ok=True)
                os.replace(body, aside / "files" / body.name)
                moved += 1
        new.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        new.close()
    return Recovery(aside, records, unreadable, moved)


def _copy_rows(
    damaged: Path, new: sqlite3.Connection, records: dict[str, int], unreadable: dict[str, str]
) -> None:
    """Every row of ``_TABLES`` readable from ``damaged`` (read-only), into ``new``."""
    try:
        old = sqlite3.connect(f"file:{damaged}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        unreadable["*"] = str(exc)
        return
    try:
        for table in _TABLES:
            records[table] = 0
            try:
                columns = [row[1] for row in new.execute(f"PRAGMA table_info({table})")]
                present = {row[1] for row in old.execute(f"PRAGMA table_info({table})")}
                shared = [c for c in columns if c in present]
                if not shared:
                    unreadable[table] = "no such table"
                    continue
                names = ", ".join(shared)
                marks = ", ".join("?" * len(shared))
                # Row by row: what is read before damage is met is kept.
                for row in old.execute(f"SELECT {names} FROM {table}"):
                    new.execute(f"INSERT OR IGNORE INTO {table} ({names}) VALUES ({marks})", row)
                    records[table] += 1
            except sqlite3.DatabaseError as exc:
                unreadable[table] = str(exc)
    finally:
        old.close()
