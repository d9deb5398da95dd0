"""The loop of a stage process (ranks 1..N-1; rank 0 is the driver and runs stage 0)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from ..deployment import Deployment
from ..memory import bound_heap_growth
from ..stage.output import PendingResult, StageOutput
from ..stage.runner import StageRunner, StageSpec
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


def stage_spec_for_rank(deployment: Deployment, rank: int, local_rank: int | None) -> StageSpec:
    spec = deployment.stage_spec(rank)
    if local_rank is not None and spec.device.type == "cuda":  # torchrun: one GPU per local rank
        spec = dataclasses.replace(spec, device=torch.device("cuda", local_rank))
    return spec


def limit_cpu_threads(deployment: Deployment, spec: StageSpec) -> None:
    """Stages sharing one CPU split its cores instead of oversubscribing them."""
    if spec.device.type == "cpu":
        cores = deployment.config.cpu_threads or usable_cpus()
        torch.set_num_threads(max(1, cores // deployment.num_stages))


def usable_cpus() -> int:
    """Cores this process may run on: its affinity (``taskset``, a container's cpuset), else
    every core."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def bind_device(spec: StageSpec) -> None:
    """Make the stage's GPU the current device before the stage is built: Triton launches a
    kernel on the current device, not on its tensors' one, so the fused q/k-norm + RoPE
    self-check at load time ran on GPU 0 with another GPU's tensors in every stage process
    but the first (until ``make_groups`` set the device, after loading)."""
    if spec.device.type == "cuda":
        torch.cuda.set_device(spec.device)


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
    deployment = pickle.loads(store.get("deployment"))
    code = run_stage(int(rank_s), rdv, deployment, store, local_rank=None)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown of process groups: the driver already moved on


def run_stage(
    rank: int, rdv: Rendezvous, deployment: Deployment, store, *, local_rank: int | None
) -> int:
    """Load the stage, then apply plans until the shutdown plan; returns an exit code."""
    bound_heap_growth()  # as the driver does: every process of the pipeline stays flat
    try:
        spec = stage_spec_for_rank(deployment, rank, local_rank)
        bind_device(spec)
        limit_cpu_threads(deployment, spec)
        runner = StageRunner(deployment.config, deployment.folder, spec)
        store.set(f"loaded/{rank}", b"1")
        groups = make_groups(store, rdv, rank, spec.device)
        inbound = DistInbound(
            groups, rank - 1, deployment.hidden_size, spec.dtype, spec.device, rank
        )
        outbound = None if spec.is_last else DistOutbound(groups, rank + 1)
        results = ResultSender(groups, hold_back=deployment.overlap_steps)
        trace = runner.trace  # None unless tracing
        while True:
            waiting = now() if trace is not None else 0
            plan = recv_object(groups.control, 0, (TAG_PLAN_LEN, TAG_PLAN))
            if trace is not None:
                trace.waited_plan(waiting, plan)
            if plan.is_shutdown:
                break
            if plan.is_flush:
                results.flush()
                continue
            if plan.is_trace:
                answer_trace(groups.control, trace and trace.export(), f"stage {rank}")
                continue
            output = runner.execute(plan, inbound, outbound)
            if output is not None:
                sending = now() if trace is not None else 0
                results.send(output)
                if trace is not None:
                    trace.host("result", sending)
        results.close()
        if outbound is not None:
            outbound.flush()
        # Under torchrun the driver has no child process to wait for: this key tells it the
        # stop plan arrived, so it does not exit (closing its connections) before we read it.
        store.set(f"stopped/{rank}", b"1")
        return 0
    except BaseException as exc:
        report_error(store, rank, exc)
        if local_rank is not None:  # torchrun: the driver may be gone; say it here as well
            traceback.print_exc()
        return 1


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

    def close(self) -> None:
        # A result still held at shutdown was never asked for: the driver stopped waiting.
        wait_all(self._sends)

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
