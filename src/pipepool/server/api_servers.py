"""The other HTTP front-end processes of ``pipepool serve --api-server-count K``.

One Python process parses, validates, tokenises, routes and serialises every request under one GIL;
on a small model that process, not the GPUs, sets the server's throughput (see
docs/benchmarks/http-server.md: about 0.6M tokens/s of short queries with one core busy). With K > 1
the main process binds the port and owns the replicas (their processes, restarts and placement), and
K - 1 processes started here serve on the same listening socket (the kernel hands each new
connection to one of the processes waiting to accept), each linked to every replica of every served
model (``replicas/shared.py``; model i's replicas listen in ``model_socket_dir``). Each front end
keeps its own queue per model (``--max-queued-requests``, a model's ``max_queued_requests``): a
model's 429 is decided by the process that took the request.

Each process is watched: one that dies is started again after a backoff (bounded as a
replica's restarts are); on shutdown each is sent SIGTERM, drains its requests as the main
process does, and is killed if it has not exited in time. Each dies with the main process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..config import EngineConfig
from ..core.restarts import RestartPolicy
from ..runtime.cores import usable_cpus
from ..runtime.signal_mask import block_stop_signals
from .settings import ServerSettings

log = logging.getLogger("pipepool.server")

# ``--api-server-count auto``: on a host of ``MIN_CORES_FOR_MORE`` cores or more, a front end
# per ``CORES_PER_API_SERVER`` of the cores the server may run on, at most
# ``MAX_AUTO_API_SERVERS``; one below (a CPU model computes on the same cores: what a second
# front end gives on two cores, docs/benchmarks/served.md, "Front ends sized to the host"). A
# front end uses about one core (its interpreter's lock; its tokenizer's batch calls run on the
# calling thread, ``intake.batch_threads``), and the others are left to the replicas and the
# stages: on the 16-core GPU hosts of issue 61 eight front ends beat four at one text a request
# and at 32 (docs/benchmarks/served.md, "Front ends on their own tokenizer threads").
CORES_PER_API_SERVER = 2
MIN_CORES_FOR_MORE = 8
MAX_AUTO_API_SERVERS = 8


def auto_api_server_count(cores: int | None = None) -> int:
    """Front-end processes of ``--api-server-count auto`` on a host with ``cores`` (default:
    the cores this process may run on): one per ``CORES_PER_API_SERVER`` from
    ``MIN_CORES_FOR_MORE`` cores, 1 to ``MAX_AUTO_API_SERVERS``."""
    if cores is None:
        cores = usable_cpus()
    if cores < MIN_CORES_FOR_MORE:
        return 1
    return min(MAX_AUTO_API_SERVERS, cores // CORES_PER_API_SERVER)


@dataclass(frozen=True)
class ApiModel:
    """One model the front ends serve: what clients call it and what it is offered for
    (``server.models.ModelNames``), its engine config and queue limit, and where its replicas
    listen (``model_socket_dir``; ``replicas.pipeline.replica_socket`` in it)."""

    names: tuple[str, ...]
    tasks: tuple[str, ...] | None
    config: EngineConfig
    max_queued_requests: int
    socket_dir: str


@dataclass(frozen=True)
class ApiServerSpec:
    """What one more front-end process is told (pickled to its stdin)."""

    settings: ServerSettings  # api_server_index says which one it is
    models: tuple[ApiModel, ...]


def model_socket_dir(root: str, index: int) -> str:
    """The directory, made if missing, in which the ``index``-th served model's replicas listen,
    under ``root`` (a directory only this user can enter)."""
    path = os.path.join(root, f"model-{index}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


class ApiServers:
    """Starts, watches, restarts and stops front-end processes 1 .. K - 1. ``on_ready()`` is
    called (from a watcher thread) once all of them serve."""

    def __init__(
        self,
        settings: ServerSettings,
        models: Sequence[ApiModel],
        sock: socket.socket,
        on_ready: Callable[[], None] = lambda: None,
    ) -> None:
        self._settings, self._models = settings, tuple(models)
        self._sock = sock
        self._on_ready = on_ready
        self._indices = range(1, settings.api_server_count)
        self._procs: dict[int, subprocess.Popen] = {}
        self._serving: set[int] = set()
        # Bounded as the first model's replicas' restarts are (--stage-restarts).
        restarts = self._models[0].config.stage_restarts
        self._policies = {i: RestartPolicy(restarts) for i in self._indices}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._announced = False

    def start(self) -> None:
        for index in self._indices:
            self._spawn(index)

    def begin_stop(self) -> None:
        """SIGTERM to each, once (they drain their requests); ``wait`` follows."""
        with self._lock:  # no process starts after this (``_spawn`` checks under the lock)
            if self._stopping.is_set():
                return
            self._stopping.set()
            procs = list(self._procs.values())
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> None:
        """Wait for every process to exit; kill those still running after ``timeout_s``."""
        self.begin_stop()
        deadline = time.monotonic() + timeout_s
        with self._lock:
            procs = list(self._procs.values())
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("API server process %d did not stop in time; killing it", proc.pid)
                proc.kill()
                proc.wait()

    # -- one process --------------------------------------------------------------------------

    def _spawn(self, index: int) -> None:
        ready_r, ready_w = os.pipe()
        fd = self._sock.fileno()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        spec = ApiServerSpec(replace(self._settings, api_server_index=index), self._models)
        with self._lock:
            if self._stopping.is_set():
                os.close(ready_r)
                os.close(ready_w)
                return
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "pipepool.server.api_worker", str(fd), str(ready_w)],
                    env=env,
                    pass_fds=(fd, ready_w),
                    stdin=subprocess.PIPE,
                )
            except BaseException:
                os.close(ready_r)
                raise
            finally:
                os.close(ready_w)
            self._procs[index] = proc
        assert proc.stdin is not None  # stdin=PIPE
        with contextlib.suppress(BrokenPipeError):  # it died at once: its watcher says so
            proc.stdin.write(pickle.dumps(spec))
            proc.stdin.close()
        threading.Thread(
            target=self._watch, args=(index, proc, ready_r), name=f"api-server-{index}", daemon=True
        ).start()

    def _watch(self, index: int, proc: subprocess.Popen, ready_r: int) -> None:
        block_stop_signals()
        with os.fdopen(ready_r, "rb") as ready:
            serving = ready.read(1) == b"r"  # b"" when it exited first
        if serving:
            with self._lock:
                self._serving.add(index)
                everyone = len(self._serving) == len(self._indices) and not self._announced
                self._announced = self._announced or everyone
            if everyone:
                self._on_ready()
        code = proc.wait()
        with self._lock:
            self._serving.discard(index)
        if self._stopping.is_set():
            return
        delay = self._policies[index].on_failure(time.monotonic())
        if delay is None:
            log.error("API server %d (pid %d) exited with code %d again; not starting it any more "
                      "(the other front ends serve on)", index, proc.pid, code)  # fmt: skip
            return
        log.warning("API server %d (pid %d) exited with code %d; starting it again in %.1f s",
                    index, proc.pid, code, delay)  # fmt: skip
        if not self._stopping.wait(delay):
            self._spawn(index)
