"""What pipepool keeps across runs in the user's cache directory: compiled kernels (see
``models/base.py``) and, where torch was installed without them, Python bytecode.

CPython compiles a module's source to bytecode on its first import and keeps it next to the
source (``__pycache__``) unless writing is switched off (``PYTHONDONTWRITEBYTECODE``) or the
directory is read-only. torch installed that way compiles thousands of its modules again at
every start: 4.6 s of a start on the GPU machine (docs/benchmarks/startup-and-host.md). There,
``keep_bytecode`` points CPython at a bytecode directory of our own (``sys.pycache_prefix``)
and lets it write there, so every start after the first reads bytecode instead.

Nothing changes where torch has its bytecode, where torch is imported already, where the user
chose a prefix (``PYTHONPYCACHEPREFIX``), or with ``PIPEPOOL_BYTECODE_CACHE=0``.
"""

from __future__ import annotations

import importlib.util
import os
import sys


def cache_dir() -> str:
    """``PIPEPOOL_CACHE_DIR``, else ``$XDG_CACHE_HOME/pipepool`` or ``~/.cache/pipepool``."""
    if os.environ.get("PIPEPOOL_CACHE_DIR"):
        return os.environ["PIPEPOOL_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pipepool")


def keep_bytecode() -> bool:
    """Keep bytecode under ``cache_dir()/pycache`` when the installed torch has none next to
    its sources; True when it does so. Call before anything imports torch."""
    if os.environ.get("PIPEPOOL_BYTECODE_CACHE", "1") == "0" or sys.pycache_prefix:
        return False
    if "torch" in sys.modules:
        return False  # too late: its modules are loaded
    try:
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.origin is None:
            return False
        if os.path.exists(importlib.util.cache_from_source(spec.origin)):
            return False  # torch's install has its bytecode
    except (ImportError, ValueError, NotImplementedError):
        return False
    sys.pycache_prefix = os.path.join(cache_dir(), "pycache")
    # The process's other imports keep their bytecode there too (that is what the prefix
    # means); only this directory is written, never the sources' own folders.
    sys.dont_write_bytecode = False
    return True
