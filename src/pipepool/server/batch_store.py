"""The Batch API's durable state: file and batch records in SQLite, file bodies on disk.

Layout of a state directory: ``batches.sqlite3`` (WAL, so that every front-end process of a
server may read and write it at once) and ``files/<file id>``, one body per file. A batch's
output and error files are written under ids chosen when the batch is created, and become
files (listed, readable) only when the batch ends.

The store's contract:

- Exactly once: the runner appends finished lines to the output and error bodies, then
  commits, in one transaction, their input line numbers and the bodies' new lengths. A run
  that resumes after a kill or a storage fault cuts each body back to its committed length
  (dropping what was written and not committed, a torn line included) and skips the committed
  lines: each line is in the output once, and only the lines in flight are run again.
- Every write is checked. A storage fault (``store_faults.py``: disk full, I/O error, damaged
  or locked database) raises ``StoreUnavailable`` (the routes answer it 507 or 503 with the
  reason) and marks the directory degraded on ``store_faults.HEALTH`` (``/health``,
  ``/metrics``) until a write succeeds again; nothing half-done is committed.
- A file's record and its body come and go together, in an order a crash cannot break: an
  upload is written to ``files/.<id>.part``, its record committed, then the body renamed into
  place; a deletion renames the body to ``files/.<id>.deleted``, commits, then unlinks it.
  ``store_check.py`` finishes either at the next start.
- The input file of an unfinished batch cannot be deleted (``FileInUse``): a batch resumed
  after a kill always has the lines it was answering.
- A store closed (``close_open_stores``, at a server's shutdown) is checkpointed into
  ``batches.sqlite3`` (``PRAGMA wal_checkpoint(TRUNCATE)``), which alone is then a complete
  copy of the records; ``store_check.py`` checks a store before a server serves it.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .batch_records import (
    ADDED_COLUMNS,
    CANCELLABLE,
    COMPLETION_WINDOW_S,
    DB_NAME,
    SCHEMA,
    UNFINISHED,
    BatchRecord,
    FileRecord,
    bodies_of,
    file_values,
    new_id,
)
from .store_faults import HEALTH, StoreHealth, StoreUnavailable
from .store_io import Transaction, checked, rename_if_there, write_all

__all__ = [
    "CANCELLABLE",
    "UNFINISHED",
    "BatchRecord",
    "BatchStore",
    "FileInUse",
    "FileRecord",
    "StoreUnavailable",
    "close_open_stores",
    "new_id",
]

log = logging.getLogger("pipepool.server")


def is_file_id(file_id: str) -> bool:
    """Whether ``file_id`` has the form of this store's file ids (``file-`` and hex digits):
    anything else names no file, and must never reach a path."""
    return file_id.startswith("file-") and file_id[5:].isalnum() and file_id.isascii()


class FileInUse(Exception):
    """A file that cannot be deleted now: the input of ``batch_id``, which is ``status``."""

    def __init__(self, file_id: str, batch_id: str, status: str) -> None:
        super().__init__(f"file {file_id} is the input of batch {batch_id} ({status})")
        self.file_id, self.batch_id, self.status = file_id, batch_id, status


class BatchStore:
    """Files and batches under one state directory (see the module's contract). Every method
    is one short transaction, so several processes may hold a store of the same directory; a
    store is used from one thread at a time. Raises ``StoreUnavailable`` on a storage fault,
    from any method, opening included."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = Path(state_dir)
        self.files_dir = self.dir / "files"
        HEALTH.register(self.dir)
        self._db = self._open()
        _OPEN_STORES.add(self)

    @checked(writes=None)
    def _open(self) -> sqlite3.Connection:
        self.files_dir.mkdir(parents=True, exist_ok=True)
        # check_same_thread off: the process closes its stores at shutdown from its main thread.
        db = sqlite3.connect(
            self.dir / DB_NAME, timeout=30, isolation_level=None, check_same_thread=False
        )
        try:
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA journal_mode=WAL")
            # NORMAL: a commit is in the WAL file when it returns, so a killed process loses
            # none (only a power loss could); FULL would fsync every flush of finished lines.
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(SCHEMA)
            for table, column, kind in ADDED_COLUMNS:  # a state directory of an earlier version
                columns = {row["name"] for row in db.execute(f"PRAGMA table_info({table})")}
                if column not in columns:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        except BaseException:
            db.close()
            raise
        return db

    @staticmethod
    def exists(state_dir: Path) -> bool:
        """Whether a store was made in ``state_dir``."""
        return (Path(state_dir) / DB_NAME).is_file()

    def close(self) -> None:
        """Close the store, checkpointing its WAL into the database file."""
        _OPEN_STORES.discard(self)
        try:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as exc:  # the state stays in the WAL, which the next start reads
            log.warning("the batch store was not checkpointed at its close: %s", exc)
        finally:
            self._db.close()

    def health(self) -> StoreHealth:
        """The directory's health as this process saw it last (``store_faults.HEALTH``, shared
        by every store of the directory in the process): ``ok``, or the fault's reason."""
        return HEALTH.health(self.dir)

    def path(self, file_id: str) -> Path:
        """Where a file's body is (or will be) on disk."""
        assert is_file_id(file_id), file_id
        return self.files_dir / file_id

    @checked(writes="file")
    def probe(self) -> None:
        """A write to the database and to the files folder, to know whether the store can be
        written again (the batch runner's, after a fault)."""
        with self._transaction():
            self._db.execute("UPDATE meta SET value = ? WHERE key = 'probe'", (int(time.time()),))
        probe = self.files_dir / ".probe"
        try:
            with open(probe, "wb") as out:
                out.write(b"\0" * (64 << 10))
                out.flush()
                os.fsync(out.fileno())
        finally:
            probe.unlink(missing_ok=True)

    @checked(writes=None)
    def opened(self, path: Path, flags: int) -> int:
        """``os.open`` of a body under the store (its faults are the store's)."""
        return os.open(path, flags, 0o600)

    @checked(writes="file")
    def append(self, fd: int, data: bytes) -> None:
        """Write all of ``data`` at ``fd`` (``opened`` with O_APPEND), partial writes resumed."""
        write_all(fd, data)

    @checked(writes="file")
    def sync(self, fd: int) -> None:
        """``os.fsync`` of a body (``opened``): on disk before its record is committed."""
        os.fsync(fd)

    def free_bytes(self) -> int | None:
        """Bytes free for this process in the state directory (None: the OS does not say)."""
        try:
            stat = os.statvfs(self.files_dir)
        except OSError:
            return None
        return stat.f_bavail * stat.f_frsize

    # -- files ---------------------------------------------------------------------------------

    def new_upload(self) -> tuple[str, Path]:
        """A fresh file id and the temporary path to write its body to (``add_file`` then)."""
        file_id = new_id("file-")
        return file_id, self.files_dir / f".{file_id}.part"

    @checked(writes="db")
    def add_file(
        self,
        file_id: str,
        part: Path,
        *,
        filename: str,
        purpose: str,
        expires_after_s: int | None = None,
    ) -> FileRecord:
        """Make the body written at ``part`` (``new_upload``) the file ``file_id``, kept for
        ``expires_after_s`` seconds (None: until deleted)."""
        size = part.stat().st_size
        now = int(time.time())
        expires = None if expires_after_s is None else now + expires_after_s
        record = FileRecord(file_id, size, now, filename, purpose, expires)
        self._db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)", file_values(record))
        try:
            os.replace(part, self.path(file_id))
        except BaseException:
            self._db.execute("DELETE FROM files WHERE id = ?", (file_id,))
            raise
        return record

    @checked(writes=None)
    def file(self, file_id: str) -> FileRecord | None:
        """A file's record; None where there is none or it has expired."""
        row = self._db.execute(
            "SELECT * FROM files WHERE id = ? AND (expires_at IS NULL OR expires_at > ?)",
            (file_id, int(time.time())),
        ).fetchone()
        return FileRecord(**row) if row else None

    @checked(writes=None)
    def delete_expired(self) -> int:
        """Delete the files whose time has come, but for the input of a batch still running
        (it is read to its end); how many went."""
        rows = self._db.execute(
            "SELECT id FROM files WHERE expires_at <= ? AND id NOT IN (SELECT input_file_id "
            f"FROM batches WHERE status IN ({', '.join('?' * len(UNFINISHED))}))",
            (int(time.time()), *UNFINISHED),
        ).fetchall()
        return sum(self.delete_file(file_id) for (file_id,) in rows)

    @checked(writes=None)
    def list_files(
        self, purpose: str | None, after: str | None, limit: int, *, newest_first: bool
    ) -> tuple[list[FileRecord], bool]:
        """Up to ``limit`` files of ``purpose`` (None: any), in the order they were stored
        (``newest_first``: the other way), following ``after`` (a file id; None: from the
        start); and whether there are more."""
        order, beyond = ("DESC", "<") if newest_first else ("ASC", ">")
        rows = self._db.execute(
            "SELECT id, bytes, created_at, filename, purpose, expires_at FROM files "
            "WHERE (? IS NULL OR purpose = ?) AND (expires_at IS NULL OR expires_at > ?) "
            f"AND (? IS NULL OR rowid {beyond} (SELECT rowid FROM files WHERE id = ?)) "
            f"ORDER BY rowid {order} LIMIT ?",
            (purpose, purpose, int(time.time()), after, after, limit + 1),
        ).fetchall()
        return [FileRecord(**r) for r in rows[:limit]], len(rows) > limit

    @checked(writes="db")
    def delete_file(self, file_id: str) -> bool:
        """Remove a file, its record and body; False if there was none. Raises ``FileInUse``
        for the input of a batch not ended yet."""
        if not is_file_id(file_id):
            return False  # no file has that id: none could have been stored under it
        body, gone = self.path(file_id), self.files_dir / f".{file_id}.deleted"
        with self._transaction():
            using = self._db.execute(
                "SELECT id, status FROM batches WHERE input_file_id = ? AND status IN "
                f"({', '.join('?' * len(UNFINISHED))}) ORDER BY seq LIMIT 1",
                (file_id, *UNFINISHED),
            ).fetchone()
            if using is not None:
                raise FileInUse(file_id, using["id"], using["status"])
            if not self._db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount:
                return False
            moved = rename_if_there(body, gone)
            try:
                self._db.execute("COMMIT")
            except BaseException:
                if moved:
                    os.replace(gone, body)
                raise
        gone.unlink(missing_ok=True)
        return True

    # -- batches -------------------------------------------------------------------------------

    @checked(writes="db")
    def create_batch(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict | None,
        output_expires_s: int | None = None,
    ) -> BatchRecord:
        now = int(time.time())
        self._db.execute(
            "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, "
            "metadata, created_at, expires_at, out_file, err_file, output_expires_s) "
            "VALUES (?, ?, ?, ?, 'validating', ?, ?, ?, ?, ?, ?)",
            (
                batch_id := new_id("batch_"), endpoint, input_file_id, completion_window,
                None if metadata is None else json.dumps(metadata), now,
                now + COMPLETION_WINDOW_S[completion_window], new_id("file-"), new_id("file-"),
                output_expires_s,
            ),
        )  # fmt: skip
        record = self.batch(batch_id)
        assert record is not None, "inserted just now"
        return record

    @checked(writes=None)
    def batch(self, batch_id: str) -> BatchRecord | None:
        row = self._db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return BatchRecord(**row) if row else None

    @checked(writes=None)
    def list_batches(self, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        """Up to ``limit`` batches, newest first, created before ``after`` (a batch id; None:
        from the newest); and whether there are more."""
        rows = self._db.execute(
            "SELECT * FROM batches WHERE (? IS NULL OR seq < "
            "(SELECT seq FROM batches WHERE id = ?)) ORDER BY seq DESC LIMIT ?",
            (after, after, limit + 1),
        ).fetchall()
        return [BatchRecord(**r) for r in rows[:limit]], len(rows) > limit

    @checked(writes=None)
    def unfinished(self) -> list[BatchRecord]:
        """Batches the runner has work on, oldest first."""
        marks = ", ".join("?" * len(UNFINISHED))
        rows = self._db.execute(
            f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY seq", UNFINISHED
        ).fetchall()
        return [BatchRecord(**r) for r in rows]

    @checked(writes=None)
    def status(self, batch_id: str) -> str | None:
        row = self._db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return row[0] if row else None

    @checked(writes="db")
    def move(self, batch_id: str, old: Iterable[str], new: str, **fields: Any) -> bool:
        """Set ``status`` to ``new`` (and ``new``'s timestamp to now, and ``fields``) if it is
        one of ``old``; whether it was. Every change of status goes through here, so that two
        processes (a cancel and the runner) cannot both move a batch from the same status."""
        old = tuple(old)
        stamp = {f"{new}_at": int(time.time())} if new != "validating" else {}
        values = {"status": new, **stamp, **fields}
        sets = ", ".join(f"{name} = ?" for name in values)
        marks = ", ".join("?" * len(old))
        changed = self._db.execute(
            f"UPDATE batches SET {sets} WHERE id = ? AND status IN ({marks})",
            (*values.values(), batch_id, *old),
        ).rowcount
        return bool(changed)

    @checked(writes="db")
    def set_total(self, batch_id: str, total: int) -> None:
        self._db.execute("UPDATE batches SET total = ? WHERE id = ?", (total, batch_id))

    def fail(self, batch_id: str, errors: list[dict[str, Any]]) -> bool:
        return self.move(batch_id, ("validating",), "failed", errors=json.dumps(errors))

    @checked(writes=None)
    def done_lines(self, batch_id: str) -> set[int]:
        rows = self._db.execute("SELECT line FROM batch_lines_done WHERE batch_id = ?", (batch_id,))
        return {line for (line,) in rows}

    @checked(writes="db")
    def record(
        self,
        batch_id: str,
        lines: list[int],
        *,
        completed: int,
        failed: int,
        sizes: tuple[int, int],
        tokens: int = 0,
    ) -> None:
        """Commit finished lines, written to the output and error bodies already: their line
        numbers, how many went to each body, the bodies' lengths now, and the prompt tokens
        the answered ones read."""
        with self._transaction():
            self._db.executemany(
                "INSERT INTO batch_lines_done VALUES (?, ?)", ((batch_id, n) for n in lines)
            )
            self._db.execute(
                "UPDATE batches SET completed = completed + ?, failed = failed + ?, "
                "out_bytes = ?, err_bytes = ?, input_tokens = input_tokens + ? WHERE id = ?",
                (completed, failed, *sizes, tokens, batch_id),
            )

    @checked(writes=None)
    def cut_to_committed(self, batch_id: str) -> None:
        """Cut a batch's output and error bodies to their committed lengths (a killed run, or
        one a storage fault stopped, may have written lines it did not commit, the last one
        torn)."""
        record = self.batch(batch_id)
        assert record is not None, batch_id
        for file_id, size in (
            (record.out_file, record.out_bytes),
            (record.err_file, record.err_bytes),
        ):
            path = self.path(file_id)
            if path.exists() and path.stat().st_size != size:
                with open(path, "r+b") as body:
                    body.truncate(size)

    @checked(writes="db")
    def finish(self, batch_id: str, status: str) -> None:
        """End a batch: its output and error bodies become files (those with a line), the
        batch says their ids, and its status becomes ``status`` (completed, cancelled,
        expired); its lines' records go. The bodies are cut to their committed lengths
        already."""
        now = int(time.time())
        with self._transaction():
            record = self.batch(batch_id)
            assert record is not None, batch_id
            bodies = bodies_of(record)
            shown = {kind: file_id if size else None for kind, (file_id, size) in bodies.items()}
            keep = record.output_expires_s
            expires = None if keep is None else now + keep
            for kind, (file_id, size) in bodies.items():
                if size:
                    self._db.execute(
                        "INSERT OR IGNORE INTO files VALUES (?, ?, ?, ?, 'batch_output', ?)",
                        (file_id, size, now, f"{batch_id}_{kind}.jsonl", expires),
                    )
            self._db.execute(
                f"UPDATE batches SET status = ?, {status}_at = ?, output_file_id = ?, "
                "error_file_id = ? WHERE id = ?",
                (status, now, shown["output"], shown["error"], batch_id),
            )
            self._db.execute("DELETE FROM batch_lines_done WHERE batch_id = ?", (batch_id,))
        for file_id, size in bodies.values():
            if not size:
                self.path(file_id).unlink(missing_ok=True)

    def _transaction(self) -> Transaction:
        return Transaction(self._db)


# The stores this process holds, closed together at its shutdown (``close_open_stores``).
_OPEN_STORES: set[BatchStore] = set()
_CLOSING = threading.Lock()


def close_open_stores() -> None:
    """Close every store this process holds, checkpointing each (at its shutdown)."""
    with _CLOSING:
        for store in list(_OPEN_STORES):
            store.close()
