"""The front end's side of one replica: talk to it, watch it; start it, or connect to it.

One sender thread ships what the front end posts (batches, aborts) as frames, in order; one
reader thread hands every frame from the replica to the front end's callbacks, and reports the
replica lost when the socket closes (the replica exited, was killed, or crashed). A handle is
one process seen through one socket: ``ReplicaProcess`` starts the process (the front end that
owns the replicas); ``ReplicaLink`` connects to one another process started (the front ends of
``--api-server-count``, ``shared.py``). A restarted replica gets a fresh handle.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from ..errors import EngineDeadError, PipepoolError
from ..runtime.signal_mask import block_stop_signals
from .messages import (
    Ready,
    Report,
    Snapshot,
    Start,
    StartFailed,
    Stop,
    TraceReply,
    TraceRequest,
    receive,
    send,
)
from .placement import ReplicaPlacement

if TYPE_CHECKING:
    from ..loading.deployment import Deployment

_STOP_WAIT_S = 10.0  # a replica asked to stop closes its engine (kills its stages) in ~1 s


@dataclass
class Listener:
    """What the front end hears from a replica's reader thread."""

    on_report: Callable[[ReplicaHandle, Report], None]
    on_lost: Callable[[ReplicaHandle, BaseException], None]


class ReplicaHandle:
    """What both kinds of handle share: the socket's two threads, readiness, the last snapshot."""

    def __init__(self, placement: ReplicaPlacement, listener: Listener) -> None:
        self.placement = placement
        self.index = placement.index
        self._listener = listener
        self.deployment: Deployment | None = None  # the replica's, once ready
        self.pid: int | None = None
        self.snapshot = Snapshot(health="starting")
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._outbox: deque = deque()
        self._wake = threading.Condition()
        self._closing = False
        self._trace_replies: dict[int, Future] = {}
        self._next_token = itertools.count()

    def _start_threads(self, conn: Connection) -> None:
        self._conn = conn
        self._reader = threading.Thread(
            target=self._read, name=f"replica-{self.index}-reader", daemon=True
        )
        self._sender = threading.Thread(
            target=self._send, name=f"replica-{self.index}-sender", daemon=True
        )
        self._reader.start()
        self._sender.start()

    # -- start-up ----------------------------------------------------------------------------

    def wait_ready(self, cancelled: Callable[[], bool] = lambda: False) -> None:
        """Block until the replica loaded its pipeline; raises why it could not."""
        while not self._ready.wait(0.1):
            if cancelled():
                raise EngineDeadError("start-up cancelled: the engine is closing")
        if self._start_error is not None:
            raise self._start_error

    # -- talking -----------------------------------------------------------------------------

    def post(self, message) -> None:
        """Queue a message for the replica (sent in order by the sender thread)."""
        with self._wake:
            self._outbox.append(message)
            self._wake.notify()

    def request_trace(self, timeout: float | None) -> list:
        """The spans of every process of the replica's pipeline (waits for its steps in
        flight); raises EngineDeadError if the replica goes away meanwhile."""
        future: Future = Future()
        token = next(self._next_token)
        self._trace_replies[token] = future
        self.post(TraceRequest(token, timeout))
        try:
            return future.result(timeout=None if timeout is None else timeout + 5)
        finally:
            self._trace_replies.pop(token, None)

    def _send(self) -> None:
        block_stop_signals()  # Ctrl-C and SIGTERM are the main thread's
        while True:
            with self._wake:
                while not self._outbox and not self._closing:
                    self._wake.wait()
                if not self._outbox:
                    return
                messages, self._outbox = list(self._outbox), deque()
            try:
                send(self._conn, messages)
            except OSError:
                return  # the reader sees the same and reports the replica lost

    def _read(self) -> None:
        block_stop_signals()
        try:
            while True:
                for message in receive(self._conn):
                    if isinstance(message, Report):
                        self.snapshot = message.snapshot
                        self._listener.on_report(self, message)
                    elif isinstance(message, Ready):
                        self.deployment, self.pid = message.deployment, message.pid
                        self._ready.set()
                    elif isinstance(message, StartFailed):
                        self._start_error = message.error
                        self._ready.set()
                    elif isinstance(message, TraceReply):
                        self._answer_trace(message)
        except (EOFError, OSError):
            pass
        for future in list(self._trace_replies.values()):
            if not future.done():
                future.set_exception(EngineDeadError(f"replica {self.index} went away"))
        if self._closing:
            return
        cause = self._exit_cause()
        if not self._ready.is_set():
            self._start_error = self._start_error or cause
            self._ready.set()
            return  # the starter reports it
        self._listener.on_lost(self, cause)

    def _answer_trace(self, reply: TraceReply) -> None:
        future = self._trace_replies.get(reply.token)
        if future is None or future.done():
            return
        if reply.error is not None:
            future.set_exception(reply.error)
        else:
            future.set_result(reply.traces)

    def _exit_cause(self) -> BaseException:
        raise NotImplementedError

    # -- stopping (each kind of handle its own way) -------------------------------------------

    def request_stop(self) -> None:
        raise NotImplementedError

    def wait_stopped(self) -> None:
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError


class ReplicaProcess(ReplicaHandle):
    """A replica process this front end starts and owns. ``listen_path``: where the replica
    also accepts the other front ends' connections (``--api-server-count``), or None."""

    def __init__(
        self, placement: ReplicaPlacement, listener: Listener, listen_path: str | None = None
    ) -> None:
        super().__init__(placement, listener)
        front, child = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        if placement.visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = placement.visible_devices
        fd = child.fileno()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "pipepool.replicas.worker", str(fd)],
                env=env,
                pass_fds=(fd,),
            )
        finally:
            child.close()
        self.pid = self._proc.pid
        conn = Connection(front.detach())
        send(conn, [Start(placement.index, placement.config, listen_path)])
        self._start_threads(conn)

    def _exit_cause(self) -> BaseException:
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # closed its socket but lives on: finish it
            self._proc.kill()
            code = self._proc.wait()
        if self.snapshot.cause:
            return EngineDeadError(f"replica {self.index} failed: {self.snapshot.cause}")
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return EngineDeadError(f"replica {self.index} process (pid {self.pid}) {how}")

    # -- stopping ----------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Ask the replica to close its engine and exit (``wait_stopped`` waits for it)."""
        self.post(Stop())
        with self._wake:
            self._closing = True
            self._wake.notify()

    def wait_stopped(self) -> None:
        """Wait for a replica asked to stop; kill it if it does not exit in time."""
        self._sender.join(timeout=2)
        try:
            self._proc.wait(timeout=_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self.kill()
        self._conn.close()

    def kill(self) -> None:
        """Now (start-up failed elsewhere, or a stop took too long). Its stage processes
        watch it and follow within a fraction of a second."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None


class ReplicaLink(ReplicaHandle):
    """A connection to a replica process another front end owns (and restarts): the replica
    answers ``Ready`` on its socket at ``path`` once it serves. Closing the link leaves the
    replica running; when the replica dies the link is lost, and a new link is made to the
    process that replaces it."""

    def __init__(
        self,
        placement: ReplicaPlacement,
        listener: Listener,
        path: str,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> None:
        super().__init__(placement, listener)
        self._start_threads(_connect(path, cancelled))

    def _exit_cause(self) -> BaseException:
        why = f": {self.snapshot.cause}" if self.snapshot.cause else " (its process ended)"
        return EngineDeadError(f"replica {self.index} (pid {self.pid}) was lost{why}")

    def request_stop(self) -> None:
        """Hang up: the replica drops this link's unfinished work and serves on."""
        with self._wake:
            self._closing = True
            self._wake.notify()

    def wait_stopped(self) -> None:
        self._sender.join(timeout=2)
        self._hang_up()

    def kill(self) -> None:
        self.request_stop()
        self._hang_up()

    def _hang_up(self) -> None:
        # shutdown(), not close(): it wakes the reader blocked in recv on this socket.
        with contextlib.suppress(OSError):
            sock = socket.fromfd(self._conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM)
            sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self._reader.join(timeout=2)
        self._conn.close()


_CONNECT_RETRY_S = 0.1


def _connect(path: str, cancelled: Callable[[], bool]) -> Connection:
    """A connection to the socket at ``path``, retried until a replica listens there (it
    binds the socket only once it is ready to serve); EngineDeadError if ``cancelled()``."""
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return Connection(sock.detach())
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
        if cancelled():
            raise EngineDeadError("start-up cancelled: the engine is closing")
        time.sleep(_CONNECT_RETRY_S)


def start_error(exc: BaseException) -> BaseException:
    """A replica's start-up failure as the caller should see it (config errors unchanged)."""
    if isinstance(exc, PipepoolError):
        return exc
    return EngineDeadError(f"a replica failed to start: {exc!r}")


class Rates:
    """Tokens per second and busy fraction of one replica over the last ``window_s``, from
    its snapshots (cumulative counters), as metrics report them."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int, float, int]] = deque()

    def add(self, snap: Snapshot, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        busy = sum(snap.stage_busy_s)
        self._samples.append((now, snap.prompt_tokens_finished, busy, len(snap.stage_busy_s)))
        while len(self._samples) > 2 and now - self._samples[1][0] > self.window_s:
            self._samples.popleft()

    def reset(self) -> None:
        """A new process counts from zero."""
        self._samples.clear()

    def tokens_per_s(self) -> float:
        if len(self._samples) < 2:
            return 0.0
        (t0, tok0, _, _), (t1, tok1, _, _) = self._samples[0], self._samples[-1]
        return max(0.0, tok1 - tok0) / max(t1 - t0, 1e-9)

    def busy_fraction(self) -> float:
        """Mean over the replica's stages of the share of wall time spent computing."""
        if len(self._samples) < 2:
            return 0.0
        (t0, _, b0, _), (t1, _, b1, stages) = self._samples[0], self._samples[-1]
        if t1 <= t0 or stages == 0 or b1 < b0:  # no time yet, or a pipeline restart reset it
            return 0.0
        return min(1.0, (b1 - b0) / ((t1 - t0) * stages))
