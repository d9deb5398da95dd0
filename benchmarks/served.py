"""A ``pipepool serve`` on a free loopback port, for the benchmarks that measure the server
(stdlib only at import: the GPU machine has httpx only where a run carries it)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(flags: list[str], env_extra: dict[str, str] | None = None):
    """Start ``pipepool serve`` with ``flags`` (and ``env_extra`` in its environment); return
    (process, base URL) once ``/health`` says ok and the server has settled (``settle``).
    Exits the script if it dies or is not ready in 300 s."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "pipepool", "serve", "--port", str(port), *flags]
    env_extra = env_extra or {}
    print("$", " ".join(f"{k}={v}" for k, v in env_extra.items()), " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, env={**os.environ, **env_extra})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                settle(proc.pid, deadline)
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not become ready in 300 s")


# A server at rest uses less CPU than this (cores, over SETTLE_WINDOW_S).
SETTLE_CORES = 0.25
SETTLE_WINDOW_S = 2.0


def settle(pid: int, deadline: float) -> None:
    """Wait until the server's processes together use less than ``SETTLE_CORES`` over
    ``SETTLE_WINDOW_S``, or until ``deadline``. A GPU server answers ``/health`` while its
    replica still compiles in the background, and torch's compile workers then take one to
    two cores of the host for tens of seconds (docs/benchmarks/served.md): a pass timed
    meanwhile measures the compile as much as the server."""
    spent = _tree_cpu_s(pid)
    while time.monotonic() < deadline:
        time.sleep(SETTLE_WINDOW_S)
        now = _tree_cpu_s(pid)
        if now - spent < SETTLE_CORES * SETTLE_WINDOW_S:
            return
        spent = now


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """User + system CPU seconds of process ``pid``, or of its thread ``thread`` alone."""
    stat = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    fields = Path(stat).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_of() -> dict[int, list[int]]:
    """Every running process's children, by parent pid (from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    return children


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    children = children_of()
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and every process below it now (one gone meanwhile: skipped)."""
    total = 0.0
    for process in descendants(pid):
        try:
            total += cpu_seconds(process)
        except OSError:
            continue
    return total
