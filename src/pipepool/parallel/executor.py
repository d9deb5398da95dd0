"""Executors deliver plans to every stage and results back to the driver.

``submit(plan)`` may return before the plan is computed; ``collect()`` returns the result of
the oldest plan not yet collected (plans complete in FIFO order on every stage).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable

from ..core.plan import StepPlan, StepResult
from ..stage.output import PendingResult
from ..stage.runner import StageRunner, current_device
from ..stage.transport import LocalLink


class Executor(ABC):
    """Delivers plans to the stages and their results back, in FIFO order.

    ``submit(plan)`` hands a plan to stage 0 (up to ``depth`` plans may be in flight);
    ``collect()`` returns the oldest plan's ``StepResult`` (blocking). A stage failure is
    raised from either as ``StageFailure`` (``failure`` says so without raising).
    Called from the engine's loop thread only.
    """

    num_stages: int
    depth: int  # how many plans may be in flight at once
    # Whether a failed pipeline can be replaced by a fresh one (stage processes this process
    # started); stages in this process or under torchrun cannot be restarted from here.
    can_restart: bool = False

    @abstractmethod
    def submit(self, plan: StepPlan) -> None: ...

    @abstractmethod
    def collect(self) -> StepResult: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    @property
    @abstractmethod
    def local_runners(self) -> list[StageRunner]:
        """The stage runners in this process: every stage of an in-process pipeline, stage 0
        of a multi-process one."""

    def check_alive(self) -> None:  # noqa: B027 - optional hook, a no-op in one process
        """Raise StageFailure if a stage is known to have failed (polled between steps)."""

    @property
    def failure(self) -> BaseException | None:
        """The recorded stage failure, if any (seen even while the engine is idle)."""
        return None

    def set_failure_listener(self, listener: Callable[[], None]) -> None:  # noqa: B027
        """``listener()`` once a stage failure is recorded by a thread of the executor's own
        (so an idle engine hears of it)."""

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until no stage of this process compiles in the background any more (stage
        processes compile before they report ready); False on timeout."""
        return True

    def gather_trace(self) -> list:
        """Every stage's trace spans (``tracing.ProcessTrace``), times on this process's clock;
        called with no plan in flight. Empty when tracing is off."""
        return []

    def declare_hung(self, reason: str) -> None:  # noqa: B027 - nothing to kill in one process
        """From any thread: the stages stopped answering; where this executor started their
        processes, record ``StageFailure(reason)`` and kill them, so that whatever waits on
        them fails at once (and the pipeline can heal)."""

    def abort(self) -> None:  # noqa: B027 - nothing to interrupt in one process
        """Stop now, from any thread: stages this process started are killed, so whatever
        waits on them fails at once. ``shutdown()`` still follows."""


class UniprocExecutor(Executor):
    """Every stage in this process, run one after the other for each plan.

    PP=1 is the production case. PP>1 here simulates the pipeline without processes, for
    tests and debugging: the same runners and the same lockstep checks, local links. On CUDA
    each stage runs with its own device current, and a link moves hidden states to the next
    stage's device.
    On CUDA two plans may be in flight, so the host prepares step k+1 while the device runs
    step k (results are copied back asynchronously and waited for in ``collect``).
    """

    def __init__(self, runners: list[StageRunner], *, depth: int = 1) -> None:
        self.runners = runners
        self.num_stages = len(runners)
        self.depth = depth
        self.links = [LocalLink(r.spec.device) for r in runners[1:]]
        self._outputs: deque[PendingResult] = deque()

    def submit(self, plan: StepPlan) -> None:
        output = None
        for k, runner in enumerate(self.runners):
            inbound = self.links[k - 1] if k > 0 else None
            outbound = self.links[k] if k < self.num_stages - 1 else None
            with current_device(runner.spec.device):
                output = runner.execute(plan, inbound, outbound)
        assert output is not None, "the last stage answers every plan"
        self._outputs.append(output.start_host_copy())

    def collect(self) -> StepResult:
        return self._outputs.popleft().result()

    def wait_compiled(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for runner in self.runners:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not runner.wait_compiled(left):
                return False
        return True

    @property
    def local_runners(self) -> list[StageRunner]:
        return self.runners

    def gather_trace(self) -> list:
        return [r.trace.export() for r in self.runners if r.trace is not None]

    def shutdown(self) -> None:
        self._outputs.clear()
        self.runners = []
