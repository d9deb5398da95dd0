"""Keep a long-running engine's memory flat: glibc's malloc with a fixed mmap threshold.

glibc serves a block from mmap (returned to the system whole when freed) only above a threshold
that it raises, by default, to the size of the largest mmapped block freed so far (up to
32 MiB). An engine's activations, results and request buffers change size with every step, so
after the first large step they come from the heap instead, where blocks of ever-new sizes
leave holes that are never given back: a server's RSS grew by ~37 MB per 1,000 requests, per
process, with no plateau. A fixed threshold (setting one switches the raising off) keeps blocks
of a MiB and more out of the heap. The price is page faults on every large block, paid as
system CPU time; measured in BENCHMARKS.md ("Memory over time").

An operator's own ``MALLOC_MMAP_THRESHOLD_`` (read by glibc at process start) wins.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

MMAP_THRESHOLD = 1 << 20  # bytes: 64 KiB kept RSS as flat, at twice the page faults
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def bound_heap_growth() -> bool:
    """Fix glibc's mmap threshold for this process (and so for every thread in it); True
    when set. A no-op off glibc, or where the environment already sets it."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
