"""One process per stage: the driver (rank 0) runs stage 0, ranks 1..N-1 run ``worker``.

Stage processes are ``python -m pipepool.parallel.worker`` children that find the driver's
TCPStore and read the pickled Deployment from it; torch.distributed connects them.

Failure handling: a supervisor thread watches the stage processes. When one exits
unexpectedly (or reports an error), the supervisor records the cause, kills every other stage
process, and so every wait the driver is blocked in fails at once; the executor then raises
the recorded cause (the stage that failed first, by name) instead of a transport error. The
engine may then start a fresh executor in its place (``can_restart``), reusing the driver's
own stage.

Stopping: nothing a stage would still compute is wanted, so ``abort`` and ``shutdown`` do not
wait for the steps in flight (a stage may be blocked handing over results nobody reads). The
driver sets ``stop`` in the engine's store; a thread in every stage process (ours, or torchrun
ranks on other hosts) waits for that key and exits the process at once with code 0. Our own
stage processes still running half a second later are killed.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

from ..core.plan import StepPlan, StepResult, flush_plan
from ..errors import PipepoolError, StageFailure
from ..loading.deployment import Deployment
from ..runtime.signal_mask import block_stop_signals
from ..stage.runner import StageRunner, new_runner
from .dist_transport import (
    TAG_PLAN,
    TAG_PLAN_LEN,
    TAG_RESULT,
    TAG_RESULT_LEN,
    DistOutbound,
    recv_object,
    send_object,
    wait_all,
)
from .executor import Executor
from .handoff import publish
from .rendezvous import engine_store, host_store, make_groups, torchrun_env, torchrun_store
from .trace_link import gather_stage_trace
from .worker import (
    STOP_KEY,
    ErrorReport,
    limit_cpu_threads,
    place_stage,
    run_stage,
)

# After the stop, how long our own stage processes get to exit by themselves (they take
# milliseconds) before they are killed.
_STOP_GRACE_S = 0.5
_FAILURE_GRACE_S = 0.3
_POLL_S = 0.05  # after a stage dies, time for the others' error reports to land


class MultiprocExecutor(Executor):
    """Stages 1..N-1 in processes of their own (started here, or torchrun's ranks), stage 0
    in this process: plans go out over the rendezvous store's control plane, hidden states
    between stages over torch.distributed, results come back from the last stage. Keeps
    ``depth`` plans in flight; a stage process that dies is reported as ``StageFailure``.
    """

    def __init__(
        self,
        deployment: Deployment,
        store,
        raw_store,
        rdv,
        procs,
        local_rank,
        *,
        stage0: StageRunner | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> None:
        self.deployment = deployment
        self.num_stages = deployment.num_stages
        self.can_restart = bool(procs)  # torchrun ranks are not ours to start again
        # N plans in flight keep N stages busy; one more lets the host run ahead of devices.
        self.overlap = deployment.overlap_steps
        self.depth = self.num_stages + int(self.overlap)
        self._uncollected = 0
        self._flush_due = False  # the last stage may be holding the newest plan's result
        self._flush_sends: list = []
        self._store, self._raw_store, self._rdv = store, raw_store, rdv
        self._procs: dict[int, subprocess.Popen] = procs
        self._failure: BaseException | None = None
        self._closing = False
        self._lock = threading.Lock()
        self._listener: Callable[[], None] | None = None
        self._plan_sends: deque[list] = deque()
        spec = place_stage(deployment, 0, local_rank)
        try:
            limit_cpu_threads(deployment, spec)
            self.runner = stage0 or new_runner(deployment, spec)
            self._wait_loaded(cancelled or (lambda: False))
            self.groups = make_groups(store, rdv, 0, spec.device)
        except BaseException:
            self._kill_all()
            raise
        self.outbound = DistOutbound(self.groups, 1)
        self._stop_supervisor = threading.Event()
        self._supervisor = threading.Thread(
            target=self._supervise, name="pipepool-supervisor", daemon=True
        )
        self._supervisor.start()

    @classmethod
    def start(
        cls,
        deployment: Deployment,
        *,
        stage0: StageRunner | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> MultiprocExecutor:
        """Start the stage processes (or join torchrun's ranks) and wait until they loaded.
        ``stage0``: the driver's stage runner of a failed executor, reused."""
        env = torchrun_env()
        if env is not None:  # launched by torchrun: the other ranks run the same command
            if env.world != deployment.num_stages:
                raise StageFailure(
                    f"torchrun started {env.world} ranks for pipeline_parallel_size="
                    f"{deployment.num_stages}"
                )
            raw, rdv = torchrun_store(env)
            return cls(deployment, engine_store(raw, rdv), raw, rdv, {}, env.local_rank)
        raw, rdv = host_store(deployment.num_stages)
        store = engine_store(raw, rdv)
        publish(store, deployment)
        child_env = dict(os.environ)
        # The stage processes import what this process imported, from the same places.
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        procs = {}
        for rank in range(1, deployment.num_stages):
            args = [str(rank), rdv.host, str(rdv.port), str(rdv.world), rdv.prefix]
            procs[rank] = subprocess.Popen(
                [sys.executable, "-m", "pipepool.parallel.worker", *args], env=child_env
            )
        return cls(deployment, store, raw, rdv, procs, None, stage0=stage0, cancelled=cancelled)

    # -- steps -----------------------------------------------------------------------------

    def submit(self, plan: StepPlan) -> None:
        self.check_alive()
        try:
            # A plan's sends complete when its stage takes it; keep up to `depth` outstanding.
            while len(self._plan_sends) >= self.depth:
                wait_all(self._plan_sends.popleft())
            worker_plan = plan.without_tokens()  # only stage 0 embeds tokens
            sends = []
            for rank in range(1, self.num_stages):
                sends += send_object(
                    self.groups.control, worker_plan, rank, (TAG_PLAN_LEN, TAG_PLAN)
                )
            self._plan_sends.append(sends)
            self._uncollected += 1
            self._flush_due = self.overlap
            self.runner.execute(plan, None, self.outbound)
        except PipepoolError as exc:
            # Stage 0's own failure (e.g. a divergence it caught) is the cause. The other
            # stages may be blocked on messages stage 0 will never send: no graceful stop.
            self._record(exc)
            raise
        except RuntimeError as exc:
            raise self._cause(exc) from None

    def collect(self) -> StepResult:
        self.check_alive()
        last = self.num_stages - 1
        try:
            if self._uncollected == 1 and self._flush_due:
                # The result wanted is the newest plan's: no later plan will release it.
                wait_all(self._flush_sends)
                self._flush_sends = send_object(
                    self.groups.control, flush_plan(), last, (TAG_PLAN_LEN, TAG_PLAN)
                )
                self._flush_due = False
            result = recv_object(self.groups.control, last, (TAG_RESULT_LEN, TAG_RESULT))
            self._uncollected -= 1
            return result
        except RuntimeError as exc:
            raise self._cause(exc) from None

    @property
    def local_runners(self) -> list[StageRunner]:
        return [self.runner]

    def gather_trace(self) -> list:
        self.check_alive()
        traces = [] if self.runner.trace is None else [self.runner.trace.export()]
        try:
            for rank in range(1, self.num_stages):
                traces.append(gather_stage_trace(self.groups.control, rank))
        except RuntimeError as exc:
            raise self._cause(exc) from None
        return traces

    def check_alive(self) -> None:
        if self._failure is not None:
            raise self._failure

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def set_failure_listener(self, listener: Callable[[], None]) -> None:
        self._listener = listener

    # -- failures ----------------------------------------------------------------------------

    def _cause(self, transport_error: BaseException) -> BaseException:
        """The recorded stage failure behind a transport error (waits briefly for it)."""
        if self._closing:  # we killed the stages ourselves
            return StageFailure("the pipeline was stopped")
        deadline = time.monotonic() + 5.0
        while self._failure is None and time.monotonic() < deadline:
            if not self._procs:  # torchrun: no children to watch, read the reports directly
                reports = self._read_reports()
                if reports:
                    self._record(_first_failure(reports))
                    break
            time.sleep(0.05)
        if self._failure is None:
            self._record(StageFailure(f"pipeline transport failed: {transport_error}"))
        assert self._failure is not None, "recorded just above, if not before"
        return self._failure

    def _supervise(self) -> None:
        block_stop_signals()
        while not self._stop_supervisor.wait(_POLL_S):
            for rank, proc in self._procs.items():
                if proc.poll() is not None and not self._closing:
                    self._on_stage_exit(rank)
                    return

    def _on_stage_exit(self, rank: int) -> None:
        time.sleep(_FAILURE_GRACE_S)
        proc = self._procs[rank]
        reports = self._read_reports()
        own = reports.get(rank)
        if own is not None and not own.secondary:
            failure = _as_failure(own)
        elif own is None:  # died without a word (killed, segfault): it is the first failure
            code = proc.returncode
            how = (
                f"was killed by signal {-code}"
                if code is not None and code < 0
                else f"exited with code {code}"
            )
            failure = StageFailure(f"stage {rank} process (pid {proc.pid}) {how}", stage=rank)
        else:
            failure = _first_failure(reports)
        self._record(failure)
        self._kill_all()  # unblocks every wait on the surviving ranks and in the driver
        if self._listener is not None:
            self._listener()

    def declare_hung(self, reason: str) -> None:
        if self._closing or not self._procs:  # closing, or torchrun's ranks: not ours to kill
            return
        self._record(StageFailure(reason))
        self._kill_all()  # the driver's wait on the last stage fails now
        if self._listener is not None:
            self._listener()

    def _read_reports(self) -> dict[int, ErrorReport]:
        reports: dict[int, ErrorReport] = {}
        for rank in range(1, self.num_stages):
            with contextlib.suppress(Exception):
                if self._store.check([f"error/{rank}"]):
                    reports[rank] = pickle.loads(self._store.get(f"error/{rank}"))
        return reports

    def _record(self, failure: BaseException) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = failure

    def _wait_loaded(self, cancelled: Callable[[], bool]) -> None:
        """Wait until every stage process loaded its weights, failing fast if one died or the
        engine is closing."""
        pending = set(range(1, self.num_stages))
        while pending:
            if cancelled():
                raise StageFailure("start-up cancelled: the engine is closing")
            for rank in list(pending):
                if self._store.check([f"loaded/{rank}"]):
                    pending.discard(rank)
            reports = self._read_reports()
            failure = _first_failure(reports) if reports else None
            dead = [r for r, p in self._procs.items() if p.poll() is not None]
            if failure is not None or dead:
                if failure is None:
                    failure = StageFailure(
                        f"stage {dead[0]} process exited during start-up "
                        f"(code {self._procs[dead[0]].returncode})",
                        stage=dead[0],
                    )
                raise failure
            time.sleep(0.02)

    # -- shutdown --------------------------------------------------------------------------

    def abort(self) -> None:
        """Stop now, from any thread. Every stage is told to exit through the store (a stage
        blocked sending results nobody reads, or waiting for a plan that never comes, exits
        at once with code 0); stage processes of ours still there after a moment are killed.
        Whatever waits on them here then fails at once."""
        if self._closing:
            return
        self._closing = True
        with contextlib.suppress(Exception):  # a store gone with its host: nobody to tell
            self._store.set(STOP_KEY, b"1")
        deadline = time.monotonic() + _STOP_GRACE_S
        if self._procs:
            for proc in self._procs.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            self._kill_all()
        else:
            self._wait_stopped(deadline)

    def shutdown(self) -> None:
        self.abort()
        self._stop_supervising()

    def _stop_supervising(self) -> None:
        if hasattr(self, "_supervisor"):
            self._stop_supervisor.set()
            self._supervisor.join(timeout=2)

    def _wait_stopped(self, deadline: float) -> None:
        """torchrun: wait until every other rank saw the stop (or reported an error); leaving
        earlier would close connections under a stage still reading from them."""
        pending = {f"stopped/{rank}" for rank in range(1, self.num_stages)}
        with contextlib.suppress(Exception):  # a store gone with its host: nothing to wait for
            while pending and time.monotonic() < deadline:
                pending = {key for key in pending if not self._store.check([key])}
                if pending and self._read_reports():
                    return
                time.sleep(0.01)

    def _kill_all(self) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs.values():
            proc.wait()


def _as_failure(report: ErrorReport) -> BaseException:
    if isinstance(report.error, PipepoolError):
        return report.error
    return StageFailure(f"stage {report.stage} failed: {report.error!r}", stage=report.stage)


def _first_failure(reports: dict[int, ErrorReport]) -> BaseException:
    """A stage's own error before the errors it caused elsewhere (closed connections)."""
    return _as_failure(min(reports.values(), key=lambda r: (r.secondary, r.stage)))


def run_torchrun_worker(deployment: Deployment) -> int:
    """Ranks > 0 under torchrun: serve as a stage until the driver (rank 0) shuts down."""
    env = torchrun_env()
    assert env is not None, "called only in a process torchrun started"
    raw, rdv = torchrun_store(env)
    return run_stage(env.rank, rdv, deployment, engine_store(raw, rdv), local_rank=env.local_rank)
