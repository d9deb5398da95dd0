"""An engine's life around its calls: the pipeline its config asks for (``open_pipeline``), and
engines a program leaves open closed at interpreter exit (``close_at_exit``)."""

from __future__ import annotations

import atexit
import contextlib
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..driver.pipeline import Pipeline
    from .engine import Engine

# At interpreter exit a loop thread still inside a step is waited for this long: the
# interpreter's teardown under a running torch op aborts the process (see _close_open_engines).
_EXIT_JOIN_S = 10.0
_open_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


def open_pipeline(config: EngineConfig) -> Pipeline:
    """The pipeline an EngineConfig asks for: replicas when ``data_parallel_size`` > 1
    (imported only then: one pipeline needs none of the replicas' modules)."""
    if config.data_parallel_size > 1:
        from ..replicas.pipeline import ReplicaPipeline

        return ReplicaPipeline(config)
    from ..driver.local import LocalPipeline

    return LocalPipeline(config)


def close_at_exit(engine: Engine) -> None:
    """Close ``engine`` at interpreter exit if it is still open then (held weakly: an engine
    that is collected first closes itself)."""
    _open_engines.add(engine)


@atexit.register
def _close_open_engines() -> None:
    """Close the engines a program left open. Without this a program that exits with work
    in flight (no close(), no ``with``) dies of SIGABRT ("terminate called without an active
    exception", exit code 134): the interpreter tears down while the loop thread still runs a
    step's torch ops. Runs before the interpreter's own teardown."""
    for engine in list(_open_engines):
        with contextlib.suppress(Exception):
            engine.close()
            engine.pipeline.close(join_timeout=_EXIT_JOIN_S)
