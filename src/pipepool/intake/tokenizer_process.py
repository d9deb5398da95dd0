"""A model's tokenizer in a process of its own, for its large batches.

A server of several models tokenises every model's requests in its one front-end process. A large
batch keeps a thread there busy in Python with the interpreter's lock held: the token ids gathered
from the Rust encodings into one array, the encodings freed. Every other model's requests need that
lock at each step of their way (the event loop, their own tokenising, the replica sockets), so under
a flood of large requests on one model the others' slowest requests waited for it
(docs/benchmarks/several-models.md, issue 35). A helper process holding the same tokenizer file does
that work instead; only the texts and the finished arrays cross the socket between them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ..runtime.cores import usable_cpus
from . import batch_threads
from .tokenizer import HelperLost, Tokenizer

# The Rust tokenizer encodes a batch on a pool of as many threads as the host has cores. Each
# front-end process has a helper per model, and a flood on one model keeps every one of its
# helpers busy at once: with a pool of the host's size each, their threads outnumbered the
# cores several times over, and the other models' requests waited for a core in the event loops
# (docs/benchmarks/several-models.md, issue 35). One model's helpers together take at most
# this share of the cores.
_HELPERS_SHARE = 0.5
# A helper that has not answered a call in this long is taken for hung, and killed: the largest
# request a server takes (--max-tokens-per-request's 300k tokens) tokenises in about a second.
ANSWER_TIMEOUT_S = 60.0


def helper_threads(front_ends: int, cores: int | None = None) -> int:
    """Threads of each helper's pool when ``front_ends`` processes each have one for a model:
    together at most ``_HELPERS_SHARE`` of ``cores`` (default: the cores this process may run
    on), at least one each."""
    if cores is None:
        cores = usable_cpus()
    return max(1, int(cores * _HELPERS_SHARE) // front_ends)


class TokenizerProcess:
    """A ``tokenizer.BatchHelper``: ``Tokenizer`` methods (``encode_flat``, ``encode_pairs``) run
    in a helper process that loads ``tokenizer_file`` itself. Calls from several threads take
    turns (one helper per tokenizer: a flood of one model's large batches queues here, not in
    front of the other models). A helper that died is started again by the next call; a call
    it could not answer (it exited, or gave no answer within ``answer_timeout_s`` and was
    killed) raises ``HelperLost``, and the caller tokenises that batch itself. The helper exits
    when ``close`` is called or the process that started it dies (its socket closes).
    ``threads``: the size of the helper's encoding pool (``RAYON_NUM_THREADS``; one the user
    set in the environment wins); None: as many as the host has cores."""

    def __init__(self, tokenizer_file: Path, threads: int | None = None) -> None:
        self._file = str(tokenizer_file)
        # The Rust pool on in the helper even where this process runs without it.
        self._env = batch_threads.child_environ()
        if threads is not None and "RAYON_NUM_THREADS" not in os.environ:
            self._env["RAYON_NUM_THREADS"] = str(threads)
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._process: subprocess.Popen | None = None
        self._closed = False
        self.answer_timeout_s = ANSWER_TIMEOUT_S
        with self._lock:
            self._start()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def run(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``Tokenizer.<method>(*args, **kwargs)`` in the helper; its exceptions re-raised."""
        with self._lock:
            if self._closed:
                raise HelperLost("the tokenizer helper is closed")
            if self._process is None or self._process.poll() is not None:
                self._start()
            assert self._conn is not None
            try:
                self._conn.send((method, args, kwargs))
                answered = self._conn.poll(self.answer_timeout_s)
                if answered:
                    ok, value = self._conn.recv()
            except (EOFError, OSError) as exc:  # it died mid-call
                self._stop()
                raise HelperLost(f"the tokenizer helper exited: {exc!r}") from None
            if not answered:
                self._stop(kill=True)
                raise HelperLost(
                    f"the tokenizer helper gave no answer in {self.answer_timeout_s:g} s and "
                    "was stopped"
                )
        if not ok:
            raise value
        return value

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._stop()

    def _start(self) -> None:
        # A fresh interpreter running this module (not multiprocessing's spawn, which would
        # import the caller's main script again), joined by a socket pair.
        self._stop()
        ours, theirs = socket.socketpair()
        with theirs:
            fd = theirs.fileno()
            self._process = subprocess.Popen(
                [sys.executable, "-m", __name__, self._file, str(fd)],
                pass_fds=(fd,),
                stdin=subprocess.DEVNULL,
                env=self._env,
            )
        # The helper holds the only other end: it reads EOF once we are gone.
        self._conn = Connection(ours.detach())

    def _stop(self, *, kill: bool = False) -> None:
        if self._conn is not None:
            self._conn.close()  # the helper's recv ends, and it exits
        if self._process is not None:
            if kill:
                self._process.kill()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._conn = self._process = None


def _serve(tokenizer_file: str, conn: Connection) -> None:
    """The helper's loop: one call at a time until the socket closes."""
    tokenizer = Tokenizer(Path(tokenizer_file))
    while True:
        try:
            method, args, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = (True, getattr(tokenizer, method)(*args, **kwargs))
        except Exception as exc:  # the caller's to raise
            reply = (False, exc)
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return


if __name__ == "__main__":
    _serve(sys.argv[1], Connection(int(sys.argv[2])))
