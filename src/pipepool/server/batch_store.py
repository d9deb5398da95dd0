"""The Batch API's durable state: file and batch records in SQLite, file bodies on disk.

Layout of a state directory: ``batches.sqlite3`` (WAL, so that every front-end process of a
server may read and write it at once) and ``files/<file id>``, one body per file. A batch's
output and error files are written under ids chosen when the batch is created, and become
files (listed, readable) only when the batch ends.

Exactly once: the runner appends finished lines to the output and error bodies, then commits,
in one transaction, their input line numbers and the bodies' new lengths. A run that resumes
after a kill cuts each body back to its committed length (dropping what was written and not
committed, a torn line included) and skips the committed lines: each line is in the output
once, and only the lines in flight at the kill are run again.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ..jobs.batch_lines import LineResult

__all__ = ["UNFINISHED", "BatchOutput", "BatchRecord", "BatchStore", "FileRecord"]

# A batch in one of these still has work for the runner; the others are final.
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
CANCELLABLE = ("validating", "in_progress")
_DB_NAME = "batches.sqlite3"
COMPLETION_WINDOW_S = {"24h": 24 * 3600}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    expires_at INTEGER  -- NULL: kept until deleted
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- creation order: lists and the runner's queue
    id TEXT NOT NULL UNIQUE,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    metadata TEXT,  -- JSON
    errors TEXT,  -- JSON: the entries of errors.data
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
    expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    output_file_id TEXT,  -- shown once the batch ended with an output line
    error_file_id TEXT,
    out_file TEXT NOT NULL,  -- the ids the output and error bodies are written under
    err_file TEXT NOT NULL,
    out_bytes INTEGER NOT NULL DEFAULT 0,  -- committed lengths of those bodies
    err_bytes INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,  -- prompt tokens of the answered lines (usage)
    output_expires_s INTEGER  -- its output and error files expire this long after they are made
);
CREATE TABLE IF NOT EXISTS batch_lines_done (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    PRIMARY KEY (batch_id, line)
) WITHOUT ROWID;
"""


@dataclass(frozen=True)
class FileRecord:
    """A stored file: OpenAI's file object fields."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str  # "batch" (uploaded) or "batch_output" (a batch's output or error file)
    expires_at: int | None = None  # when it is deleted; None: kept until deleted


@dataclass(frozen=True)
class BatchRecord:
    """A batch as stored: OpenAI's batch object fields, and where its output goes."""

    seq: int
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    metadata: str | None  # JSON
    errors: str | None  # JSON list
    created_at: int
    expires_at: int
    in_progress_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    total: int  # requests in the input file (0 while validating)
    completed: int  # lines in the output body: answered with a 2xx
    failed: int  # lines in the error body
    output_file_id: str | None
    error_file_id: str | None
    out_file: str
    err_file: str
    out_bytes: int
    err_bytes: int
    input_tokens: int  # prompt tokens the answered lines read (OpenAI's usage)
    output_expires_s: int | None  # output and error files expire this long after made


class BatchStore:
    """Files and batches under one state directory. Every method is one short transaction,
    so several processes may hold a store of the same directory; a store is used from one
    thread (the event loop's)."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = Path(state_dir)
        self.files_dir = self.dir / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.dir / _DB_NAME, timeout=30, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL: a commit is in the WAL file when it returns, so a killed process loses none
        # (only a power loss could); FULL would fsync every flush of finished lines.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        for table, column, kind in _ADDED_COLUMNS:  # a state directory of an earlier version
            columns = {row["name"] for row in self._db.execute(f"PRAGMA table_info({table})")}
            if column not in columns:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")

    @staticmethod
    def exists(state_dir: Path) -> bool:
        """Whether a store was made in ``state_dir``."""
        return (Path(state_dir) / _DB_NAME).is_file()

    def close(self) -> None:
        self._db.close()

    def path(self, file_id: str) -> Path:
        """Where a file's body is (or will be) on disk."""
        assert "/" not in file_id and file_id.startswith("file-"), file_id
        return self.files_dir / file_id

    # -- files ---------------------------------------------------------------------------------

    def new_upload(self) -> tuple[str, Path]:
        """A fresh file id and the temporary path to write its body to (``add_file`` then)."""
        file_id = new_id("file-")
        return file_id, self.files_dir / f".{file_id}.part"

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
        os.replace(part, self.path(file_id))
        now = int(time.time())
        expires = None if expires_after_s is None else now + expires_after_s
        record = FileRecord(file_id, size, now, filename, purpose, expires)
        self._db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)", _values(record))
        return record

    def file(self, file_id: str) -> FileRecord | None:
        """A file's record; None where there is none or it has expired."""
        row = self._db.execute(
            "SELECT * FROM files WHERE id = ? AND (expires_at IS NULL OR expires_at > ?)",
            (file_id, int(time.time())),
        ).fetchone()
        return FileRecord(**row) if row else None

    def delete_expired(self) -> int:
        """Delete the files whose time has come, but for the input of a batch still running
        (it is read to its end); how many went."""
        rows = self._db.execute(
            "SELECT id FROM files WHERE expires_at <= ? AND id NOT IN (SELECT input_file_id "
            f"FROM batches WHERE status IN ({', '.join('?' * len(UNFINISHED))}))",
            (int(time.time()), *UNFINISHED),
        ).fetchall()
        return sum(self.delete_file(file_id) for (file_id,) in rows)

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

    def delete_file(self, file_id: str) -> bool:
        """Remove a file, its record and body; False if there was none."""
        deleted = self._db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount
        if deleted:
            self.path(file_id).unlink(missing_ok=True)
        return bool(deleted)

    # -- batches -------------------------------------------------------------------------------

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

    def batch(self, batch_id: str) -> BatchRecord | None:
        row = self._db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return BatchRecord(**row) if row else None

    def list_batches(self, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        """Up to ``limit`` batches, newest first, created before ``after`` (a batch id; None:
        from the newest); and whether there are more."""
        rows = self._db.execute(
            "SELECT * FROM batches WHERE (? IS NULL OR seq < "
            "(SELECT seq FROM batches WHERE id = ?)) ORDER BY seq DESC LIMIT ?",
            (after, after, limit + 1),
        ).fetchall()
        return [BatchRecord(**r) for r in rows[:limit]], len(rows) > limit

    def unfinished(self) -> list[BatchRecord]:
        """Batches the runner has work on, oldest first."""
        marks = ", ".join("?" * len(UNFINISHED))
        rows = self._db.execute(
            f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY seq", UNFINISHED
        ).fetchall()
        return [BatchRecord(**r) for r in rows]

    def status(self, batch_id: str) -> str | None:
        row = self._db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return row[0] if row else None

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

    def set_total(self, batch_id: str, total: int) -> None:
        self._db.execute("UPDATE batches SET total = ? WHERE id = ?", (total, batch_id))

    def fail(self, batch_id: str, errors: list[dict[str, Any]]) -> bool:
        return self.move(batch_id, ("validating",), "failed", errors=json.dumps(errors))

    def done_lines(self, batch_id: str) -> set[int]:
        rows = self._db.execute("SELECT line FROM batch_lines_done WHERE batch_id = ?", (batch_id,))
        return {line for (line,) in rows}

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

    def cut_to_committed(self, batch_id: str) -> None:
        """Cut a batch's output and error bodies to their committed lengths (a killed run may
        have written lines it did not commit, the last one torn)."""
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

    def finish(self, batch_id: str, status: str) -> None:
        """End a batch: its output and error bodies become files (those with a line), the
        batch says their ids, and its status becomes ``status`` (completed, cancelled,
        expired); its lines' records go. The bodies are cut to their committed lengths
        already."""
        now = int(time.time())
        with self._transaction():
            record = self.batch(batch_id)
            assert record is not None, batch_id
            bodies = _bodies(record)
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

    def _transaction(self):
        return _Transaction(self._db)


class BatchOutput:
    """The output and error bodies of a batch in progress, open for appending (cut to their
    committed lengths first: ``BatchStore.cut_to_committed``). ``write`` appends finished
    lines, then commits them: the exactly-once step."""

    def __init__(self, store: BatchStore, record: BatchRecord) -> None:
        self.store, self.batch_id = store, record.id
        self.sizes = [record.out_bytes, record.err_bytes]  # committed, then as written
        self._paths = (store.path(record.out_file), store.path(record.err_file))
        self._files: list[BinaryIO] = []

    def __enter__(self) -> BatchOutput:
        self._files = [open(path, "ab") for path in self._paths]  # noqa: SIM115
        return self

    def __exit__(self, *_exc) -> None:
        for file in self._files:
            file.close()

    def write(self, results: list[LineResult]) -> None:
        if not results:
            return
        for index, file in enumerate(self._files):
            data = b"".join(r.text for r in results if r.ok == (index == 0))
            if data:
                file.write(data)
                file.flush()  # in the kernel's hands: a killed process loses none of it
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


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on an exception): the write lock is taken at the
    start, so a transaction never fails half-way on another process's lock."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind, _value, _traceback) -> None:
        self.db.execute("COMMIT" if kind is None else "ROLLBACK")


def _bodies(record: BatchRecord) -> dict[str, tuple[str, int]]:
    """A batch's output and error bodies: their file ids and committed lengths."""
    return {
        "output": (record.out_file, record.out_bytes),
        "error": (record.err_file, record.err_bytes),
    }


def new_id(prefix: str) -> str:
    """An id as OpenAI's look: a prefix and 24 random hex digits."""
    return f"{prefix}{secrets.token_hex(12)}"


def _values(record: FileRecord) -> tuple:
    return (
        record.id, record.bytes, record.created_at, record.filename, record.purpose,
        record.expires_at,
    )  # fmt: skip


# Columns added after the first release of the store: (table, column, type).
_ADDED_COLUMNS = (
    ("files", "expires_at", "INTEGER"),
    ("batches", "input_tokens", "INTEGER NOT NULL DEFAULT 0"),
    ("batches", "output_expires_s", "INTEGER"),
)
