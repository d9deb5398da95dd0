"""What a storage fault of the Batch store is, what it answers, and where the process keeps the
store's health.

A fault is an error of the disk or the database under a state directory: no space left
(ENOSPC, EDQUOT, SQLite's SQLITE_FULL), an I/O error (EIO, a read-only file system, SQLite's
SQLITE_IOERR), a damaged database (SQLITE_CORRUPT, SQLITE_NOTADB) or one held too long by
another process (SQLITE_BUSY). ``fault_of`` tells one from a bug (a programming error stays a
500). A store that meets one raises ``StoreUnavailable``: an ``APIError`` that answers 507
(insufficient storage: free space, then retry) or 503 (the store cannot be used now), with the
reason in OpenAI's error body, and marks the state directory degraded on ``HEALTH``, the board
``/health`` and ``/metrics`` read. The next write that succeeds marks it healthy again.
"""

from __future__ import annotations

import errno
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import SERVER, APIError
from .health import ComponentHealth

__all__ = [
    "HEALTH",
    "StoreHealth",
    "StoreHealthBoard",
    "StoreUnavailable",
    "fault_of",
    "store_check",
    "store_metrics",
]

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# SQLite's primary result codes (the low byte of an extended code) that are storage faults.
_SQLITE_FULL = 13
_SQLITE_FAULTS = {
    5: "the database is locked by another process (SQLITE_BUSY)",
    6: "a table is locked (SQLITE_LOCKED)",
    8: "the database is read-only (SQLITE_READONLY)",
    10: "a disk I/O error (SQLITE_IOERR)",
    11: "the database file is damaged (SQLITE_CORRUPT)",
    13: "the disk is full (SQLITE_FULL)",
    14: "the database file cannot be opened (SQLITE_CANTOPEN)",
    15: "a locking protocol error (SQLITE_PROTOCOL)",
    26: "the file is not a database (SQLITE_NOTADB)",
}
# How long a client is told to wait before trying again.
RETRY_AFTER_S = 5


@dataclass(frozen=True)
class StoreHealth:
    """A state directory's health as this process saw it last: ``ok``, or why not (``reason``,
    since ``since``, a Unix time), and whether freeing disk space is the cure (``full``).
    ``errors`` counts the faults met since the process started, healed ones too."""

    ok: bool = True
    reason: str | None = None
    full: bool = False
    since: float | None = None
    errors: int = 0


class StoreUnavailable(APIError):
    """A storage fault, as an HTTP answer: 507 when the disk is full, 503 otherwise; its
    ``reason`` names the directory and the OS's or SQLite's error."""

    def __init__(self, reason: str, *, full: bool) -> None:
        cure = "free disk space there" if full else "the server's log says more"
        super().__init__(
            507 if full else 503,
            f"the batch store cannot be written: {reason}; {cure}. Batches in progress wait "
            "and go on by themselves once it can",
            type=SERVER,
            code="insufficient_storage" if full else "storage_unavailable",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
        self.reason = reason
        self.full = full


def fault_of(exc: BaseException, where: Path) -> StoreUnavailable | None:
    """``exc`` as a storage fault of the store at ``where``; None when it is none (a bug, or a
    file that is simply not there)."""
    if isinstance(exc, StoreUnavailable):
        return exc
    if isinstance(exc, OSError) and not isinstance(
        exc, FileNotFoundError | IsADirectoryError | NotADirectoryError
    ):
        why = exc.strerror or str(exc)
        return StoreUnavailable(
            f"{why} (errno {exc.errno}) in {where}", full=exc.errno in _FULL_ERRNOS
        )
    if isinstance(exc, sqlite3.OperationalError | sqlite3.DatabaseError) and not isinstance(
        exc, sqlite3.ProgrammingError | sqlite3.IntegrityError | sqlite3.InterfaceError
    ):
        code = getattr(exc, "sqlite_errorcode", None)
        primary = None if code is None else code & 0xFF
        if primary is not None and primary not in _SQLITE_FAULTS:
            return None  # a wrong statement: a bug
        why = _SQLITE_FAULTS.get(primary or 0, "a database error")
        return StoreUnavailable(f"{why}: {exc} in {where}", full=primary == _SQLITE_FULL)
    return None


class StoreHealthBoard:
    """The health of each state directory this process uses, shared by its stores (the
    routes' and the batch runner's, on different threads): ``failed`` on a fault, ``wrote`` on
    a write that succeeded. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._health: dict[Path, StoreHealth] = {}

    def register(self, state_dir: Path) -> None:
        """A store of ``state_dir`` is open in this process (healthy unless told otherwise)."""
        with self._lock:
            self._health.setdefault(_key(state_dir), StoreHealth())

    def failed(self, state_dir: Path, fault: StoreUnavailable) -> bool:
        """Record a fault; whether the directory was healthy until now."""
        key = _key(state_dir)
        with self._lock:
            old = self._health.get(key, StoreHealth())
            since = old.since if not old.ok and old.since is not None else time.time()
            self._health[key] = StoreHealth(False, fault.reason, fault.full, since, old.errors + 1)
            return old.ok

    def wrote(self, state_dir: Path) -> bool:
        """Record a write that succeeded; whether the directory was degraded until now."""
        key = _key(state_dir)
        with self._lock:
            old = self._health.get(key, StoreHealth())
            self._health[key] = StoreHealth(errors=old.errors)
            return not old.ok

    def health(self, state_dir: Path) -> StoreHealth:
        with self._lock:
            return self._health.get(_key(state_dir), StoreHealth())

    def known(self, state_dir: Path) -> bool:
        """Whether a store of ``state_dir`` was used in this process."""
        with self._lock:
            return _key(state_dir) in self._health


def _key(state_dir: Path) -> Path:
    return Path(state_dir).resolve()


# The process's board: one per process, as the stores it tracks are the process's own.
HEALTH = StoreHealthBoard()


def store_check(state_dir: Path) -> Callable[[], ComponentHealth]:
    """The store's check for ``/health`` and ``/metrics`` (``health.HealthChecks``): ok until a
    storage fault, then not ok, with the fault, until a write succeeds again."""

    def check() -> ComponentHealth:
        if not HEALTH.known(state_dir):
            return ComponentHealth(ok=True)  # no store was used here
        health = HEALTH.health(state_dir)
        return ComponentHealth(ok=health.ok, detail=None if health.ok else health.reason)

    return check


def store_metrics(state_dir: Path) -> str:
    """The store's fault count in Prometheus' text format (empty when no store was used here);
    whether it works now is ``pipepool_component_ok{component="batch_store"}``
    (``store_check``)."""
    if not HEALTH.known(state_dir):
        return ""
    health = HEALTH.health(state_dir)
    return (
        "# HELP pipepool_batch_store_faults_total storage faults the Batch store met\n"
        "# TYPE pipepool_batch_store_faults_total counter\n"
        f"pipepool_batch_store_faults_total {health.errors}\n"
    )
