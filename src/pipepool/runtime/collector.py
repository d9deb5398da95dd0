"""Keep Python's cycle collector from pausing a serving process for what it imported.

A full collection walks every object the collector tracks. A serving process holds ~470,000
of them from torch, transformers and the server's modules before it takes a request: one full
collection there took 0.82 s on the loaded 2-core machine, and a flood of large requests makes
the collector run full collections now and then, each holding the GIL, so every request of the
process waits.

``freeze_startup_objects`` moves every object alive at that moment to the permanent generation
(``gc.freeze``), which collections skip: afterwards a full collection walks only what serving
made (a freeze of that process made the next full collection take microseconds). Called by the
processes that are ours once they are ready to serve: the server's front end, a replica, a
pipeline stage. Never by the library: a user's process keeps its collector as it had it.

``QuietCollections`` then moves the full collections of the server's front end to quiet
moments (``server.online_gate.OnlineGate.settled``: a second without an online request), since
a flood keeps many objects in flight and CPython's own schedule walks them all every few
seconds.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable


def freeze_startup_objects() -> None:
    """Exclude every object alive now from later collections (what start-up made lives as long
    as the process does)."""
    gc.freeze()


# Generation 2's threshold that CPython never reaches: its full collections are ours to run.
_NEVER = 1 << 30
# The longest a paced process goes without a full collection while it is never quiet: the most
# its cyclic garbage that outlived two young collections waits to be freed.
FULL_COLLECTION_EVERY_S = 60.0


class QuietCollections:
    """Full collections of a serving process, run when it is quiet instead of when CPython's
    counters say.

    CPython runs a full collection once enough objects have outlived two young collections:
    under a flood of large requests, every few seconds, each walking every object in flight and
    holding the GIL throughout, which pauses every request of the process at once. With this
    class the front end of an H200 server ran no full collection during a 15 s flood
    (docs/benchmarks/several-models.md, issue 35). From ``start()``, automatic
    collections are young ones only (generations 0 and 1, where most cyclic garbage dies), and a
    thread of this class runs the full one: when ``quiet()`` says the process is quiet (the
    server: ``OnlineGate.settled``), or after ``every_s`` without a quiet moment.
    ``stop()`` gives the thresholds back."""

    def __init__(
        self,
        quiet: Callable[[], bool],
        *,
        every_s: float = FULL_COLLECTION_EVERY_S,
        poll_s: float = 0.5,
    ) -> None:
        self.quiet = quiet
        self.every_s = every_s
        self.poll_s = poll_s
        self.full_collections = 0  # started by this object
        self._stopped = threading.Event()
        self._thresholds: tuple[int, int, int] | None = None
        self._thread = threading.Thread(
            target=self._run, name="pipepool-quiet-collections", daemon=True
        )

    def start(self) -> None:
        young, older, _ = self._thresholds = gc.get_threshold()
        gc.set_threshold(young, older, _NEVER)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._thresholds is not None:
            gc.set_threshold(*self._thresholds)
            self._thresholds = None

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stopped.wait(self.poll_s):
            if not gc.get_count()[2]:
                continue  # no young collection since the last full one: nothing new to walk
            now = time.monotonic()
            if self.quiet() or now - last >= self.every_s:
                self.full_collections += 1  # counted first: what it frees may be awaited
                gc.collect()
                last = now
