"""Bounded memory: blocks of ever-new sizes go back to the system once the engine fixed glibc's
mmap threshold, instead of staying in the heap as holes (numpy stands in for the activations
of steps of varying sizes; a fresh process each, so the allocator starts from its defaults)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_STEPS = """
import random, sys
import numpy as np
from pipepool.memory import bound_heap_growth

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
print(bounded, round(rss_mb() - before))
"""


def _retained_mb(mode: str) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, env=env, check=True
    ).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc, /proc")
def test_fixed_mmap_threshold_returns_blocks_of_new_sizes_to_the_system():
    bounded, retained = _retained_mb("bounded")
    assert bounded
    assert retained < 16, f"{retained} MB still held after the steps"
    # Without it, glibc keeps them: the heap grew by what the steps freed.
    _, default = _retained_mb("default")
    assert default > 48, f"glibc's defaults kept only {default} MB: the premise changed"


def test_an_operators_own_threshold_wins(monkeypatch):
    from pipepool.memory import bound_heap_growth

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert bound_heap_growth() is False
