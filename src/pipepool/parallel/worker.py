"""The loop of a stage process (ranks 1..N-1; rank 0 is the driver and runs stage 0)."""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from ..loading.deployment import Deployment
from ..loading.stage_spec import StageSpec
from ..runtime.collector import freeze_startup_objects
from ..runtime.cores import usable_cpus
from ..runtime.memory import bound_heap_growth
from ..stage.output import PendingResult, StageOutput
from ..stage.runner import new_runner
from ..tracing.recorder import now
from .dist_transport import (
    TAG_PLAN,
    TAG_PLAN_LEN,
    TAG_RESULT,
    TAG_RESULT_LEN,
    DistInbound,
    DistOutbound,
    recv_object,
    send_object,
    wait_all,
)
from .handoff import receive
from .rendezvous import Rendezvous, connect_store, engine_store, make_groups
from .trace_link import answer_trace


@dataclass
class ErrorReport:
    """What a failing stage leaves in the store for the driver."""

    stage: int
    error: BaseException | str
    # True when the error is only the consequence of another rank going away
    # (a closed connection), so the driver can name the stage that failed first.
    secondary: bool


def place_stage(deployment: Deployment, rank: int, local_rank: int | None) -> StageSpec:
    """This process's stage, on its device: ``set_device`` comes before any other CUDA work
    (loading weights, kernel self-checks), so nothing lands on another rank's GPU."""
    spec = deployment.stage_spec(rank, local_rank)
    if spec.device.type == "cuda":
        torch.cuda.set_device(spec.device)
    return spec


def limit_cpu_threads(deployment: Deployment, spec: StageSpec) -> None:
    """Stages sharing one CPU split its cores instead of oversubscribing them."""
    if spec.device.type == "cpu":
        cores = deployment.config.cpu_threads or usable_cpus()
        torch.set_num_threads(max(1, cores // deployment.num_stages))


def worker_main(argv: list[str] | None = None) -> None:
    """Entry point of a stage process the driver started:
    ``python -m pipepool.parallel.worker RANK HOST PORT WORLD PREFIX``.

    A process of our own rather than multiprocessing's spawn, which would re-run the user's
    main script in every stage unless it is guarded by ``if __name__ == "__main__"``.
    """
    _die_with_parent()
    # The driver owns shutdown: Ctrl-C, or a SIGTERM sent to the whole process group (as
    # systemd does), must let it finish in-flight requests before it stops the stages.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank_s, host, port_s, world_s, prefix = (argv if argv is not None else sys.argv[1:])[:5]
    rdv = Rendezvous(host, int(port_s), int(world_s), prefix, torchrun=False)
    store = engine_store(connect_store(rdv), rdv)
    rank = int(rank_s)
    try:
        deployment = receive(store, rank)  # checked against the driver's digest before loading
    except BaseException as exc:
        report_error(store, rank, exc)
        os._exit(1)
    code = run_stage(rank, rdv, deployment, store, local_rank=None)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown of process groups: the driver already moved on


def run_stage(
    rank: int, rdv: Rendezvous, deployment: Deployment, store, *, local_rank: int | None
) -> int:
    """Load the stage, then apply plans until the driver's stop ends the process (exit code
    0, from ``_exit_when_stopped``); returns an exit code only when the stage failed."""
    bound_heap_growth()  # as the driver does: every process of the pipeline stays flat
    stop = _exit_when_stopped(rdv, rank)
    try:
        spec = place_stage(deployment, rank, local_rank)  # the device is current from here
        limit_cpu_threads(deployment, spec)
        runner = new_runner(deployment, spec)
        store.set(f"loaded/{rank}", b"1")
        groups = make_groups(store, rdv, rank, spec.device)
        inbound = DistInbound(
            groups, rank - 1, deployment.hidden_size, spec.dtype, spec.device, rank,
            runner.model.received_rows,
        )  # fmt: skip
        outbound = None if spec.is_last else DistOutbound(groups, rank + 1)
        results = ResultSender(groups, hold_back=deployment.overlap_steps)
        trace = runner.trace  # None unless tracing
        freeze_startup_objects()
        while True:  # until the driver's stop (``_exit_when_stopped``) ends the process
            waiting = now() if trace is not None else 0
            plan = recv_object(groups.control, 0, (TAG_PLAN_LEN, TAG_PLAN))
            if trace is not None:
                trace.waited_plan(waiting, plan)
            if plan.is_flush:
                results.flush()
                continue
            if plan.is_trace:
                exported = trace.export() if trace is not None else None
                answer_trace(groups.control, exported, f"stage {rank}")
                continue
            output = runner.execute(plan, inbound, outbound)
            if output is not None:
                sending = now() if trace is not None else 0
                results.send(output)
                if trace is not None:
                    trace.host("result", sending)
    except BaseException as exc:
        if stop.is_set() or _stop_requested(store):
            # The driver stopped and closed its connections: no failure. The watcher thread
            # is exiting the process with code 0.
            while True:
                time.sleep(1)
        report_error(store, rank, exc)
        if local_rank is not None:  # torchrun: the driver may be gone; say it here as well
            traceback.print_exc()
        return 1


STOP_KEY = "stop"


def _exit_when_stopped(rdv: Rendezvous, rank: int) -> threading.Event:
    """A thread that waits for the driver's ``stop`` key and then exits this process with
    code 0, whatever the stage is blocked on. A connection of its own: a TCPStore client
    serialises its operations, and this one blocks. The event is set once the stop came."""
    stopped = threading.Event()
    store = engine_store(connect_store(rdv), rdv)

    def run() -> None:
        while True:
            try:
                store.wait([STOP_KEY], _STOP_POLL)
                break
            except Exception as exc:
                if "timeout" not in str(exc).lower():  # the store went away with the driver
                    os._exit(1)
        stopped.set()
        with contextlib.suppress(Exception):
            # Under torchrun the driver has no child process to wait for: this key tells it
            # the stop arrived, so it does not close connections under a stage still reading.
            store.set(f"stopped/{rank}", "1")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no interpreter teardown: process groups with operations in flight

    threading.Thread(target=run, name="pipepool-stop-watch", daemon=True).start()
    return stopped


# One wait for the whole life of the stage: a TCPStore wait that times out logs a C++ warning,
# and a stage idle for hours must not print one a minute.
_STOP_POLL = datetime.timedelta(days=365)


def _stop_requested(store) -> bool:
    try:
        return bool(store.check([STOP_KEY]))
    except Exception:
        return False


class ResultSender:
    """The last stage's results on their way to the driver.

    With ``hold_back``, step k's result leaves only after step k+1 was queued on the device:
    reading it back waits for the device, and a host waiting there would leave the device idle
    while it then receives and prepares step k+1. The driver sends a flush plan when it is
    about to wait for a result that no further plan would release.
    """

    def __init__(self, groups, *, hold_back: bool) -> None:
        self.groups, self.hold_back = groups, hold_back
        self._held: PendingResult | None = None
        self._sends: list = []

    def send(self, output: StageOutput) -> None:
        pending = output.start_host_copy()  # device to host, behind the step on its stream
        if not self.hold_back:
            self._send(pending)
            return
        self.flush()
        self._held = pending

    def flush(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            self._send(held)

    def _send(self, pending: PendingResult) -> None:
        wait_all(self._sends)
        self._sends = send_object(
            self.groups.control, pending.result(), 0, (TAG_RESULT_LEN, TAG_RESULT)
        )


def report_error(store, rank: int, exc: BaseException) -> None:
    secondary = isinstance(exc, RuntimeError) and _is_connection_error(exc)
    report = ErrorReport(rank, exc, secondary)
    try:
        payload = pickle.dumps(report)
    except Exception:
        payload = pickle.dumps(ErrorReport(rank, f"{type(exc).__name__}: {exc}", secondary))
    with contextlib.suppress(Exception):  # the driver is gone too: nobody to tell
        store.set(f"error/{rank}", payload)


def _is_connection_error(exc: BaseException) -> bool:
    """Transport errors (a neighbour went away) rather than this stage's own failure."""
    text = str(exc).lower()
    markers = ("gloo/transport", "connection closed", "connection reset", "broken pipe", "nccl")
    return any(m in text for m in markers)


def _die_with_parent() -> None:
    """Exit as soon as the driver process is gone, so a crashed driver leaves no orphaned
    stage behind. (PR_SET_PDEATHSIG would fire when the *thread* that started us exits, which
    kills the stages of an engine built in a short-lived thread.)"""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, name="pipepool-parent-watch", daemon=True).start()


if __name__ == "__main__":
    # Run through the package module, not __main__, so that what this process pickles
    # (ErrorReport) names a class the driver can import.
    from pipepool.parallel import worker

    worker.worker_main()
