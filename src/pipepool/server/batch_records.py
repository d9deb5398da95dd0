"""The Batch store's records: the SQLite schema, and the file and batch objects as stored."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

__all__ = [
    "ADDED_COLUMNS",
    "CANCELLABLE",
    "COMPLETION_WINDOW_S",
    "DB_NAME",
    "SCHEMA",
    "UNFINISHED",
    "BatchRecord",
    "FileRecord",
    "bodies_of",
    "file_values",
    "new_id",
]

# A batch in one of these still has work for the runner; the others are final.
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
CANCELLABLE = ("validating", "in_progress")
DB_NAME = "batches.sqlite3"
COMPLETION_WINDOW_S = {"24h": 24 * 3600}

SCHEMA = """
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
-- probe: the row the batch runner writes to know whether the store can be written again.
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
INSERT OR IGNORE INTO meta VALUES ('probe', 0);
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


def bodies_of(record: BatchRecord) -> dict[str, tuple[str, int]]:
    """A batch's output and error bodies: their file ids and committed lengths."""
    return {
        "output": (record.out_file, record.out_bytes),
        "error": (record.err_file, record.err_bytes),
    }


def new_id(prefix: str) -> str:
    """An id as OpenAI's look: a prefix and 24 random hex digits."""
    return f"{prefix}{secrets.token_hex(12)}"


def file_values(record: FileRecord) -> tuple:
    return (
        record.id, record.bytes, record.created_at, record.filename, record.purpose,
        record.expires_at,
    )  # fmt: skip


# Columns added after the first release of the store: (table, column, type).
ADDED_COLUMNS = (
    ("files", "expires_at", "INTEGER"),
    ("batches", "input_tokens", "INTEGER NOT NULL DEFAULT 0"),
    ("batches", "output_expires_s", "INTEGER"),
)
