"""The seam between the ``Engine`` facade and what computes its requests.

The facade validates, tokenises and slices a call's inputs (``intake``) and hands token
batches to a ``Pipeline``: one pipeline of stages (``LocalPipeline``) or replicas of it
(``ReplicaPipeline``). Every engine feature — tracing, health, death callbacks, statistics,
probes — goes through this protocol, so it works on both.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..core.stats import EngineStats
    from ..core.submission import Submission
    from ..intake.inputs import TokenSlice
    from ..loading.deployment import Deployment
    from ..tracing.recorder import ProcessTrace


class Pipeline(Protocol):
    """Runs the token batches of an Engine's calls and writes their results into each call's
    ``Submission``. Every method may be called from any thread.

    ``health``: ok | degraded (healing: calls wait, then run) | dead | closed. Once dead or
    closed, every pending call has failed and ``enqueue`` raises ``EngineDeadError``.
    """

    deployment: Deployment

    @property
    def stats(self) -> EngineStats: ...

    @property
    def health(self) -> str: ...

    @property
    def tracing(self) -> bool: ...

    @property
    def kv_blocks_free(self) -> int | None: ...

    @property
    def kv_blocks_total(self) -> int: ...

    @property
    def cause_of_death(self) -> BaseException | None: ...

    def enqueue(self, submission: Submission, part: TokenSlice) -> None:
        """Queue one slice of a call's prompts; raises EngineDeadError once dead or closed."""
        ...

    def cancel(self, submission: Submission) -> None:
        """Drop whatever of the call is unfinished (its future is already cancelled)."""
        ...

    def slice_intake(self) -> AbstractContextManager[Callable[[], object]]:
        """Around the enqueueing of a call that comes in several slices: yields what the
        caller runs after each slice (a wait that keeps it out of the loop's way)."""
        ...

    def add_death_callback(self, fn: Callable[[BaseException], None]) -> None:
        """``fn(cause)`` once the pipeline fails for good (not on close), or at once."""
        ...

    def wait_until_compiled(self, timeout: float | None) -> bool:
        """Block until every stage computes with its compiled layer bodies (False after
        ``timeout`` seconds); runs a one-token call of its own (``probe.py``) to switch them."""
        ...

    def stage_busy_s(self) -> list[float]:
        """Seconds each stage has computed so far (replica-major for replicas), brought up to
        date by a one-token call of its own."""
        ...

    def gather_trace(self, timeout: float | None) -> list[list[ProcessTrace]]:
        """Every process's spans, one list per pipeline (one for a ``LocalPipeline``, one per
        replica), on this host's clock."""
        ...

    def replica_status(self) -> list:
        """Per replica: state, pid, devices, load (``replicas.stats.ReplicaStatus``); empty
        for one pipeline."""
        ...

    def raise_if_dead(self) -> None: ...

    def close(self, join_timeout: float = ...) -> None:
        """Stop everything now; pending calls fail with EngineDeadError("engine closed").
        ``join_timeout``: how long to wait for a loop thread still inside a step."""
        ...
