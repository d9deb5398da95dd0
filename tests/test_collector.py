"""``runtime.collector.QuietCollections``: once started, CPython runs young collections only;
the full ones run when the process is quiet, or at the latest after ``every_s`` under a load
that never pauses; cyclic garbage that outlived the young collections is freed by them; stop
gives CPython its thresholds back."""

from __future__ import annotations

import gc
import threading

from pipepool.runtime.collector import QuietCollections

TIMEOUT_S = 30


class Cycle:
    """An object in a reference cycle, which says when it is freed."""

    def __init__(self, freed: threading.Event) -> None:
        self.me = self
        self.freed = freed

    def __del__(self) -> None:
        self.freed.set()


class FullCollections:
    """Counts generation-2 collections (``gc.callbacks``) and says when there were ``n``."""

    def __init__(self) -> None:
        self.count = 0
        self.reached = threading.Event()
        self.wanted = 1

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2:
            self.count += 1
            if self.count >= self.wanted:
                self.reached.set()


def _promote_to_old_generation(freed: threading.Event) -> None:
    """Leave a cycle in the oldest generation, as garbage that was long in use ends there."""
    alive = [Cycle(freed)]
    gc.collect(1)  # still in use: moved to the oldest generation
    alive.clear()  # now garbage there, which only a full collection frees


def test_full_collections_wait_for_a_quiet_moment_then_free_old_cycles():
    thresholds = gc.get_threshold()
    quiet = threading.Event()
    collections = QuietCollections(quiet=quiet.is_set, every_s=3600, poll_s=0.01)
    full = FullCollections()
    gc.callbacks.append(full)
    try:
        collections.start()
        assert gc.get_threshold()[:2] == thresholds[:2]
        assert gc.get_threshold()[2] > 1_000_000  # CPython's own full collections: off
        freed = threading.Event()
        _promote_to_old_generation(freed)
        assert not freed.is_set()
        # Busy: young collections only, however many.
        for _ in range(50):
            gc.collect(1)
        assert not freed.is_set() and collections.full_collections == 0
        quiet.set()
        assert freed.wait(TIMEOUT_S)  # the next poll found it quiet and collected
        assert collections.full_collections >= 1
    finally:
        gc.callbacks.remove(full)
        collections.stop()
    assert gc.get_threshold() == thresholds


def test_a_load_that_never_pauses_still_gets_a_full_collection_every_so_often():
    collections = QuietCollections(quiet=lambda: False, every_s=0.05, poll_s=0.01)
    full = FullCollections()
    full.wanted = 2
    gc.callbacks.append(full)
    try:
        collections.start()
        freed = threading.Event()
        _promote_to_old_generation(freed)
        assert freed.wait(TIMEOUT_S)
        gc.collect(1)  # something new for the next one to walk
        assert full.reached.wait(TIMEOUT_S)
    finally:
        gc.callbacks.remove(full)
        collections.stop()
