"""A ``pipepool serve`` on a free loopback port, for the benchmarks that measure the server
(stdlib only at import: the GPU machine has httpx only where a run carries it)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(flags: list[str], env_extra: dict[str, str] | None = None):
    """Start ``pipepool serve`` with ``flags`` (and ``env_extra`` in its environment); return
    (process, base URL) once ``/health`` says ok. Exits the script if it dies or is not ready in
    300 s."""
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
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not become ready in 300 s")
