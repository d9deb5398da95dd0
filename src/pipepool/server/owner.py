"""The thread that builds, holds and closes the server's engine.

The server answers (``/health`` says 503) while the model loads, so the engine is built off
the main thread. That thread must then live as long as the engine: stage processes ask Linux
to kill them when their parent *thread* exits (PR_SET_PDEATHSIG follows the thread that
started them), so a loader thread that returned would take the pipeline down with it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from ..api.engine import Engine

log = logging.getLogger("pipepool.server")


class EngineOwner:
    """``engine`` is None until loaded (and after a failed load, with ``error`` set).
    ``on_failure(cause)`` hears of a failed load, and of an engine that failed for good later
    (``error`` is set then too): the server stops, and exits non-zero."""

    def __init__(self, build: Callable[[], Engine]) -> None:
        self._build = build
        self.engine: Engine | None = None
        self.error: BaseException | None = None
        self.loaded = threading.Event()  # set when the load finished, well or not
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._own, name="pipepool-engine-owner")

    def start(
        self,
        on_failure: Callable[[BaseException], None],
        on_ready: Callable[[Engine], None] = lambda engine: None,
    ) -> None:
        self._on_failure = on_failure
        self._on_ready = on_ready
        self._thread.start()

    def close(self) -> None:
        """Stop the engine (waits for a load in progress to finish first)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _own(self) -> None:
        try:
            self.engine = self._build()
        except BaseException as exc:
            self.error = exc
            self.loaded.set()
            self._on_failure(exc)
            return
        self.loaded.set()
        self.engine.pipeline.add_death_callback(self._died)
        self._on_ready(self.engine)
        self._stop.wait()
        self.engine.close()

    def _died(self, cause: BaseException) -> None:
        log.error("the engine failed and cannot recover: %s", cause)
        self.error = cause
        self._on_failure(cause)


def model_engine(
    config,
    open_replicas: Callable,
    where: str | None,
    *,
    beside_others: bool,
    front_ends: int,
) -> Engine:
    """The engine of one served model over its replicas, ``open_replicas(config, where)``
    (owned by this process, or linked to: ``ReplicaPipeline`` or ``SharedReplicas``; ``where``:
    the directory they listen in, None for none); a dual encoder's vision tower's the same way,
    in ``where``'s "vision" directory. ``beside_others``: its large batches are tokenised in a
    helper process of its own (``intake.tokenizer_process``; in this process they would hold up
    the other models' requests), whose pool is its share of the cores among the ``front_ends``
    processes that each have one for this model. Its model computes in the replicas, so this
    process is a front end: it makes its tokenizer's batch calls on threads of its own
    (``intake.batch_threads``)."""
    from ..core.dual_encoders import DUAL_ENCODERS
    from ..intake import batch_threads
    from ..intake.tokenizer_process import TokenizerProcess, helper_threads

    batch_threads.use_own_threads()
    pipeline = open_replicas(config, where)
    vision = None
    try:
        if pipeline.deployment.folder.architecture in DUAL_ENCODERS:
            vision = open_replicas(config.replace(tower="vision"), vision_socket_dir(where))
    except BaseException:
        pipeline.close()
        raise
    engine = Engine.from_config(config, pipeline, vision)
    if beside_others:
        tokenizer = engine.tokenizer
        try:
            helper = TokenizerProcess(tokenizer.file, helper_threads(front_ends))
            tokenizer.use_helper(helper)
        except BaseException:
            engine.close()
            raise
    return engine


def vision_socket_dir(where: str | None) -> str | None:
    """Where a dual encoder's vision-tower replicas listen: a directory in its model's (made
    if missing, this user's only); None where the replicas listen nowhere."""
    if where is None:
        return None
    path = os.path.join(where, "vision")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path
