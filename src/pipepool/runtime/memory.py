"""Keep a long-running engine's memory flat without paying page faults for it: glibc's malloc
with fixed thresholds, and its heap trimmed on a timer.

glibc serves a block from mmap (returned to the system whole when freed, and faulted in page by
page on every new use) only above a threshold that it raises, by default, to the size of the
largest mmapped block freed so far (up to 32 MiB), and it hands the top of the heap back at
every free above a trim threshold it moves along with it. An engine's activations, results and
request buffers change size with every step, so without help blocks of ever-new sizes leave
holes in the heap that are never given back: a server's RSS grew by ~37 MB per 1,000 requests,
per process, with no plateau.

A low fixed threshold (1 MiB, an earlier version of this module) kept those blocks out of the
heap, at the price of page faults on every one of them, every step: on the CPU, where a step's
activations are MiBs each, that was 30% of the engine's throughput (system time 23 s of 100 s
on the bundled model; docs/benchmarks/cpu.md). So the thresholds are now fixed high
(``MMAP_THRESHOLD``: every activation of a CPU step at the default token budget comes from the
heap and is reused step after step; ``TRIM_THRESHOLD``: a free does not shrink the heap only for
the next step to grow it again), and the holes are dealt with by the trimmer below.

Every ``TRIM_EVERY_S`` a daemon thread calls ``malloc_trim(0)``, which hands every whole free
page of every arena back to the system (it moves nothing; a walk over the free lists,
milliseconds): the holes that varied step sizes leave, and the scattered free pages a server
leaves when it allocates small blocks (request texts, token arrays, response bodies) in one
thread and frees them in another (the soak saw those grow ~35 MB per 1,000 requests). What a trim
gives back is faulted in again when the heap reuses it, so the interval trades memory for
system time: on the bundled model on the CPU, 2 s against 10 s held 573-646 MB instead of
766-858 MB at ~3% more system time (throughput within this machine's noise).

On the CPU, oneDNN (PyTorch's CPU kernel library) keeps a cache of compiled primitives, one per
operator and input shape, 1,024 by default. A step's token count takes any value up to the
budget, so the cache fills with shapes that rarely recur, a few hundred KiB each: an engine
on the CPU held 940-1,080 MB after 3,000 varied calls with the default and 726-798 MB with
``ONEDNN_CACHE_CAPACITY`` entries, a cache that is full within the first few hundred requests
(docs/benchmarks/http-server.md). PyTorch's oneDNN bindings (ideep) keep a second cache of their own
for some ops, the fused linear + residual add among them (``layers/cpu_linear.py``), 1,024
entries by default (``LRU_CACHE_CAPACITY``), each holding a compiled kernel of ~250 KiB per
row count: a CPU server filled it slowly, ~250 MB over its first ~8,000 requests, and its
memory only levelled off then (a malloc trace named the holder). Both are bounded here.

An operator's own ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` (read by glibc at
process start), ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` and ``LRU_CACHE_CAPACITY`` win.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading

MMAP_THRESHOLD = 32 << 20  # bytes: glibc's own upper bound for it
TRIM_THRESHOLD = 64 << 20  # bytes of free heap top kept between trims
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
TRIM_EVERY_S = 2.0  # 10 s held ~200 MB more on the CPU; 2 s cost ~3% more system time
ONEDNN_CACHE_CAPACITY = 128  # primitives; oneDNN's own default is 1,024
IDEEP_CACHE_CAPACITY = 128  # ideep's cache of the same (LRU_CACHE_CAPACITY); its default 1,024
_trimmer: threading.Thread | None = None
_trimmer_lock = threading.Lock()


def bound_heap_growth() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (and so for every thread in it),
    start the thread that trims the heap and bound oneDNN's kernel caches; True when the
    thresholds are set. The heap part is a no-op off glibc, and the thresholds are left alone
    where the environment already sets one."""
    # Both are read once, when the first kernel is built: callers run before any compute.
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(IDEEP_CACHE_CAPACITY))
    libc = _libc()
    if libc is None:
        return False
    _start_trimmer(libc)
    if {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & os.environ.keys():
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def trim_heap() -> bool:
    """Give every whole free page of glibc's arenas back to the system now; True if any was."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 - musl and others have neither
    except (OSError, AttributeError):
        return None
    libc.malloc_trim.argtypes = (ctypes.c_size_t,)
    return libc


def _start_trimmer(libc) -> None:
    global _trimmer
    with _trimmer_lock:
        if _trimmer is not None and _trimmer.is_alive():
            return
        stop = threading.Event()  # never set: the thread lives as long as the process

        def trim_forever() -> None:
            while not stop.wait(TRIM_EVERY_S):
                libc.malloc_trim(0)

        _trimmer = threading.Thread(target=trim_forever, name="pipepool-heap-trim", daemon=True)
        _trimmer.start()
