"""Triton, where installed, for the engine's kernels (CUDA; CPU-only installs have none), and
whether Triton's interpreter runs them (``TRITON_INTERPRET=1``, read at import as Triton reads
it: the tests run the kernels on the CPU that way)."""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None
    tl = None

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

__all__ = ["INTERPRETING", "tl", "triton"]
