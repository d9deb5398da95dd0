"""Bounded memory without page faults: a step's large blocks come from glibc's heap (reused, not
mmapped and faulted in anew every step), and the holes that blocks of ever-new sizes leave in
the heap go back to the system when it is trimmed (numpy stands in for the activations of steps
of varying sizes; a fresh process each, so the allocator starts from its defaults)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Slow: a fresh process per allocator measurement.
pytestmark = pytest.mark.slow

_STEPS = """
import random, sys
import numpy as np
from pipepool.runtime.memory import bound_heap_growth, trim_heap

bounded = bound_heap_growth() if sys.argv[1] == "bounded" else False

def rss_mb():
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024

rng = random.Random(0)
small = []  # small blocks that outlive a step (request state, results)
before = rss_mb()
for step in range(60):
    tokens = rng.randrange(16, 4096)  # a step's size, new every time
    live = []
    for layer in range(6):  # activations, freed out of order
        live.append(np.ones(tokens * 1536, np.float32))
        live.append(np.ones(tokens * 384, np.float32))
        small.append(np.ones(rng.randrange(16, 512), np.uint8))
        del small[:-300]
        if len(live) > 3:
            live.pop(rng.randrange(len(live)))
    del live
held = rss_mb() - before
trim_heap()  # what the engine's trimmer thread does every TRIM_EVERY_S
print(bounded, round(held), round(rss_mb() - before))
"""


def _retained_mb(mode: str) -> tuple[bool, int, int]:
    """(thresholds set, MB held after the steps, MB held after a trim)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, env=env, check=True
    ).stdout.split()
    return out[0] == "True", int(out[1]), int(out[2])


# glibc's heap statistics (mallinfo2: glibc 2.33+), run before each script below.
_MALLINFO = """
import ctypes

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
"""

_THRESHOLD = """
import sys
import numpy as np
from pipepool.runtime.memory import bound_heap_growth

if sys.argv[1] == "bounded":
    bound_heap_growth()
before = libc.mallinfo2().hblks
block = np.ones(16 << 20, np.uint8)  # a CPU step's activation at the default budget
print(libc.mallinfo2().hblks - before)  # 1: the 16 MiB block was mmapped; 0: heap
"""


def _mmapped_first_large_block(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    cmd = [sys.executable, "-c", _MALLINFO + _THRESHOLD, mode]
    return int(subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc, /proc")
def test_large_blocks_come_from_the_heap_and_its_holes_go_back_when_trimmed():
    bounded, held, retained = _retained_mb("bounded")
    assert bounded
    assert retained < 16, f"{retained} MB still held after the trim ({held} MB before it)"
    # By default glibc mmaps a block this large (its threshold starts at 128 KiB), and every
    # such block is faulted in page by page; with the thresholds fixed it comes from the heap.
    assert _mmapped_first_large_block("default") == 1
    assert _mmapped_first_large_block("bounded") == 0


def test_an_operators_own_threshold_wins(monkeypatch):
    from pipepool.runtime.memory import bound_heap_growth

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert bound_heap_growth() is False


def test_onednn_kernel_caches_are_bounded_unless_the_operator_sized_them(monkeypatch):
    """oneDNN and ideep read their capacities when they build their first kernel; every
    engine process calls bound_heap_growth before any compute."""
    from pipepool.runtime.memory import (
        IDEEP_CACHE_CAPACITY,
        ONEDNN_CACHE_CAPACITY,
        bound_heap_growth,
    )

    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        monkeypatch.delenv(name, raising=False)
    bound_heap_growth()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(ONEDNN_CACHE_CAPACITY)
    assert os.environ["LRU_CACHE_CAPACITY"] == str(IDEEP_CACHE_CAPACITY)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "4096")
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "2048")
    bound_heap_growth()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "4096"
    assert os.environ["LRU_CACHE_CAPACITY"] == "2048"


_ROW_COUNTS = """
import sys
import torch
from pipepool.layers import cpu_linear
from pipepool.runtime.memory import bound_heap_growth

if sys.argv[1] == "bounded":
    bound_heap_growth()  # after importing torch, as an engine does

if not cpu_linear.supported():
    print("unsupported")
    sys.exit()
torch.set_num_threads(1)
w, b = torch.randn(256, 64), torch.randn(256)
packed = cpu_linear.pack(w)
with torch.inference_mode():
    held = [libc.mallinfo2().uordblks]
    for rows in range(1, 401):  # a CPU tile's row count is new at almost every step
        cpu_linear.linear_add(torch.randn(rows, 64), torch.randn(rows, 256), packed, b)
        if rows % 200 == 0:
            held.append(libc.mallinfo2().uordblks)
    print((held[1] - held[0]) / 2**20, (held[2] - held[1]) / 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_fused_linear_kernels_of_ever_new_row_counts_stay_bounded():
    """The fused linear + residual add (``cpu_linear.linear_add``) compiles a kernel per row
    count and ideep caches them: with its defaults every new row count holds more memory that
    nothing frees; bounded, the first 128 fill the cache and later ones replace them."""
    env = {
        k: v for k, v in os.environ.items()
        if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    }  # fmt: skip

    def growth_mb(mode: str) -> tuple[float, float]:
        """MB newly held over the first 200 row counts, and over the next 200."""
        out = subprocess.run(
            [sys.executable, "-c", _MALLINFO + _ROW_COUNTS, mode],
            capture_output=True, text=True, env=env, check=True,
        ).stdout.strip()  # fmt: skip
        if out == "unsupported":
            pytest.skip("this torch build has no fused oneDNN linear ops")
        first, second = map(float, out.split())
        return first, second

    first, second = growth_mb("defaults")
    assert second > 0.5 * first > 10, f"defaults: {first:.0f} then {second:.0f} MB held"
    first, second = growth_mb("bounded")
    assert second < 0.1 * first, f"bounded: {first:.0f} MB, then {second:.0f} MB more held"


_SCATTERED = """
import sys, threading
import numpy as np
from pipepool.runtime.memory import trim_heap

def rss_mb():
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024

kept = []
def work():  # a tokenising / serialising thread: medium blocks, a few outliving the rest
    blocks = [np.ones(50_000 + 64 * i, np.uint8) for i in range(3000)]  # ~150 MB, < 1 MiB each
    kept.extend(blocks[::100])  # pins every heap region it lands in
    blocks.clear()
t = threading.Thread(target=work)
t.start()
t.join()
before = rss_mb()
trim_heap()
print(round(before - rss_mb()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc, /proc")
def test_trimming_returns_free_pages_scattered_through_a_threads_arena():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", _SCATTERED], capture_output=True, text=True, env=env, check=True
    ).stdout
    assert int(out) > 64, f"malloc_trim gave back only {out.strip()} MB"


def test_free_gpu_memory_counts_what_this_process_holds_unused(monkeypatch):
    """An engine closed earlier in the process leaves its blocks in torch's allocator, where the
    driver counts them as taken: the next engine's KV cache is sized after they are given back."""
    import torch

    from pipepool.loading.deployment import free_gpu_bytes

    gib = 2**30
    held = {"unused": 10 * gib}  # the closed engine's blocks, cached by the allocator
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: held.update(unused=0))
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda device=None: (12 * gib - held["unused"], 80 * gib)
    )
    assert free_gpu_bytes() == 12 * gib
