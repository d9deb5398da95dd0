"""How a corpus job writes into its output folder: every file whole or not at all, and one job
at a time.

A file is written under a temporary name in the same folder (``.NAME.<random>.tmp``), flushed
to disk and renamed over ``NAME``: a reader, or a rerun after SIGKILL or a power cut, sees the
old file or the new one, never part of one. Ctrl-C removes the temporary file; SIGKILL leaves
it, and the next job in the folder removes it (``remove_leftovers``) under the folder's lock,
so it never removes a running job's file.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from ..errors import InvalidInputError

LOCK = ".lock"
# The temporary names ``atomic_write`` makes, whatever the final name.
_TEMP = re.compile(r"^\..+\.[0-9a-f]{8}\.tmp$")


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """``write(file)`` into a temporary file next to ``path``, then that file renamed to
    ``path``; on any exception (KeyboardInterrupt too) the temporary file is removed and
    ``path`` is as it was."""
    temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(temp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    """The rename itself on disk: without it a power cut may forget it."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_leftovers(folder: Path) -> list[Path]:
    """Remove the temporary files a killed job left in ``folder``; returns them. Call it
    holding ``locked(folder)``."""
    found = [p for p in folder.iterdir() if _TEMP.match(p.name) and p.is_file()]
    for path in found:
        path.unlink(missing_ok=True)
    return found


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """Hold ``folder``'s lock for the block: a second job writing into it is refused
    (InvalidInputError) instead of racing the first. The kernel releases the lock when its
    process dies, SIGKILL included, so no stale lock outlives a job."""
    import fcntl  # POSIX only: imported here so that `pipepool embed` itself loads anywhere

    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InvalidInputError(
                f"another job is writing into {folder} (it holds {folder / LOCK}); wait for it "
                "or stop it first",
                param="output_dir",
            ) from None
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
