"""Keep Python's cycle collector from pausing a serving process for what it imported.

A full collection walks every object the collector tracks. A serving process holds ~470,000
of them from torch, transformers and the server's modules before it takes a request: one full
collection there took 0.82 s on the loaded 2-core machine, and a flood of large requests makes
the collector run full collections now and then, each holding the GIL, so every request of the
process waits (issue 35: the other models' p99 at 10-24x idle while one model was flooded).

``freeze_startup_objects`` moves every object alive at that moment to the permanent generation
(``gc.freeze``), which collections skip: afterwards a full collection walks only what serving
made (a freeze of that process made the next full collection take microseconds). Called by the
processes that are ours once they are ready to serve: the server's front end, a replica, a
pipeline stage. Never by the library: a user's process keeps its collector as it had it.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Exclude every object alive now from later collections (what start-up made lives as long
    as the process does)."""
    gc.freeze()
