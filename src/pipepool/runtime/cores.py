"""The cores this process may run on: what sizes its thread pools and helper processes."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """Cores this process may run on: its affinity (``taskset``, a container's cpuset), else
    every core."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
