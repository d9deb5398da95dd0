"""A script of kernel checks, run in Triton's interpreter in a fresh process (the interpreter
is chosen when Triton is imported), or its ``check`` taken into this one (on a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys


def run_interpreted(script: str, timeout: int = 600) -> None:
    """Run ``script`` with ``TRITON_INTERPRET=1``; it must end by printing "ok"."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def check_of(script: str):
    """The ``check`` function ``script`` defines, to run in this process."""
    namespace: dict = {}
    exec(script, namespace)
    return namespace["check"]
