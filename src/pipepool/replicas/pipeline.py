"""``ReplicaPipeline``: the ``Pipeline`` of an Engine over N replica pipelines
(``data_parallel_size``).

The Engine facade does what comes before the scheduler — validation, tokenisation,
long-input windows, scoring pairs — and hands token batches to ``enqueue``: each is routed
(``routing.split_rows``) to the replicas with the fewest outstanding tokens, and their results
stream back into the caller's ``Submission``.

Failures reuse the single-pipeline mechanism one level up. Each replica's ``Owners`` records
which rows of which call it holds; when a replica is lost (its process died) or is healing (a
stage died and its engine restarts it), ``Owners.requeue`` turns its unfinished rows into new
batches of the same calls, which run on the other replicas. The lost replica is started again
after ``RestartPolicy``'s backoff, within its bounds (``stage_restarts`` in 5 minutes). Calls
fail only when every replica has been given up on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from ..config import EngineConfig
from ..core.request import RequestBatch
from ..core.restarts import RestartPolicy
from ..core.stats import EngineStats
from ..core.submission import Submission
from ..driver.owners import Owner
from ..driver.probe import probe_call
from ..errors import EngineDeadError, PipepoolError
from ..intake.inputs import TokenSlice
from ..loading.model_folder import read_model_folder
from ..runtime.signal_mask import block_stop_signals
from ..tracing.recorder import ProcessTrace
from .handle import Listener, ReplicaHandle, ReplicaProcess, start_error
from .messages import Abort, Report, Work
from .placement import plan_placement
from .routing import split_rows
from .slot import Slot, State
from .stats import ReplicaStatus, merged_stats, replica_status

if TYPE_CHECKING:
    from ..loading.deployment import Deployment

log = logging.getLogger("pipepool")


def replica_socket(socket_dir: str, index: int) -> str:
    """Where replica ``index`` accepts the connections of other front-end processes."""
    return os.path.join(socket_dir, f"replica-{index}.sock")


class ReplicaPipeline:
    """The pipeline of ``Engine(model, data_parallel_size=N)``: N replicas (``replicas/``),
    each a process running a one-pipeline engine. ``deployment`` is replica 0's (devices as it
    sees them); ``placements`` say where every replica runs; ``replica_status()`` reports each.

    ``socket_dir``: the replicas also serve the front ends of other processes
    (``shared.SharedReplicas``), each through ``replica_socket(socket_dir, r)``; None: only
    this one. Callbacks from the replicas arrive on their reader threads; ``_lock`` guards
    every slot.
    """

    _restart_message = "starting replica %d again"

    def _start_replica(self, placement, cancelled=lambda: False) -> ReplicaHandle:
        """A handle on a new process of this replica (its wait_ready() follows)."""
        path = None if self.socket_dir is None else replica_socket(self.socket_dir, placement.index)
        return ReplicaProcess(placement, self._listener, path)

    def __init__(self, config: EngineConfig, socket_dir: str | None = None) -> None:
        self.socket_dir = socket_dir
        self._closed = True  # until fully started, close() has nothing to stop
        self.config = config
        self.placements = plan_placement(config)
        # A missing or malformed folder is reported now, not after N interpreters started (and
        # a hub id is downloaded once, not by every replica at the same time).
        read_model_folder(config.model)
        self._lock = threading.Condition()
        self._slots = [Slot(p, RestartPolicy(config.stage_restarts)) for p in self.placements]
        self._listener = Listener(self._on_report, self._on_lost)
        self._next_id = 0
        self._backlog: list[Owner] = []  # work waiting for a replica to take it
        self._dead: BaseException | None = None
        self._stop = False
        self._on_death: list = []
        self._restarting: list[threading.Thread] = []
        self.front_stats = EngineStats(0)  # what the front end counts itself
        started: list[ReplicaHandle] = []  # slot by slot
        try:
            for slot in self._slots:
                slot.proc = self._start_replica(slot.placement)
                started.append(slot.proc)
            for proc in started:
                proc.wait_ready()
        except BaseException as exc:
            for proc in started:
                proc.kill()
            raise start_error(exc) from exc
        deployment = started[0].deployment
        assert deployment is not None, "a ready replica has sent its deployment"
        self.deployment: Deployment = deployment
        # What the log calls this model (a server may hold several): its folder's name.
        self._model = deployment.folder.path.name
        # A batch worth splitting fills at least one step of each replica it goes to.
        self._min_split = self.deployment.max_num_batched_tokens
        for slot, proc in zip(self._slots, started, strict=True):
            slot.state = State.OK
            log.info("%s: %s, pid %d", self._model, slot.placement.describe(), proc.pid)
        self._closed = False

    # -- what differs from one pipeline --------------------------------------------------------

    @property
    def stats(self) -> EngineStats:
        """Counters of the whole engine: the front end's own, plus every replica's (summed;
        ``stage_busy_s`` replica-major, one entry per stage of each replica)."""
        with self._lock:
            return merged_stats(self.front_stats, self._slots)

    def replica_status(self) -> list[ReplicaStatus]:
        """Per replica: state, pid, devices, load, queue, tokens/s, busy fraction, restarts."""
        with self._lock:
            return [replica_status(slot) for slot in self._slots]

    @property
    def tracing(self) -> bool:
        return bool(self.config.trace)

    @property
    def cause_of_death(self) -> BaseException | None:
        return self._dead

    @property
    def kv_blocks_free(self) -> int | None:
        if not self.deployment.causal:
            return None
        with self._lock:
            snaps = [s.proc.snapshot for s in self._slots if s.proc is not None]
        return sum(s.kv_blocks_free or 0 for s in snaps)

    @property
    def kv_blocks_total(self) -> int:
        return self.deployment.num_kv_blocks * len(self._slots)

    @property
    def health(self) -> str:
        """ok (every replica serves) | degraded (some replica is restarting: its work runs on
        the others, or waits if none is left) | dead (every replica given up on) | closed."""
        if self._closed:
            return "closed"
        if self._dead is not None:
            return "dead"
        if all(slot.state == State.OK for slot in self._slots):
            return "ok"
        return "degraded"

    def wait_until_compiled(self, timeout: float | None) -> bool:
        """Replicas report ready once compiled (``worker.py``): nothing to wait for."""
        return True

    def stage_busy_s(self) -> list[float]:
        """Seconds each stage of each replica (replica-major) has computed so far; a one-token
        request to every serving replica brings the figures up to date first."""
        probes = []
        with self._lock:
            self.raise_if_dead()
            for slot in self._slots:
                if slot.state == State.OK:
                    submission, part = probe_call(self.deployment, self.cancel)
                    self._assign(slot, submission, 0, self._new_batch(submission, part))
                    probes.append(submission)
        for submission in probes:
            submission.result()
        return list(self.stats.stage_busy_s)

    def gather_trace(self, timeout: float | None) -> list[list[ProcessTrace]]:
        """Every serving replica's processes' spans (each replica's driver and stages)."""
        with self._lock:
            self.raise_if_dead()
            procs = [slot.serving_proc() for slot in self._slots if slot.state == State.OK]
        return [proc.request_trace(timeout) for proc in procs]

    def add_death_callback(self, fn) -> None:
        with self._lock:
            dead = self._dead
            if dead is None:
                self._on_death.append(fn)
        if dead is not None:
            fn(dead)

    def close(self, join_timeout: float = 30.0) -> None:
        """Stop every replica (each closes its engine and stage processes) and fail what is
        pending with EngineDeadError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop = True
            self._lock.notify_all()
            restarting = list(self._restarting)
        for thread in restarting:
            thread.join(timeout=join_timeout)
        procs = [slot.proc for slot in self._slots if slot.proc is not None]
        for proc in procs:
            proc.request_stop()
        for proc in procs:
            proc.wait_stopped()
        self._fail_pending(EngineDeadError("engine closed"))

    # -- intake --------------------------------------------------------------------------------

    def slice_intake(self) -> contextlib.AbstractContextManager:
        """Nothing to wait for or tell: the replicas' loop threads run in their own processes
        and see each slice as it comes."""
        return contextlib.nullcontext(lambda: None)

    def enqueue(self, submission: Submission, part: TokenSlice) -> None:
        with self._lock:
            self.raise_if_dead()
            batch = self._new_batch(submission, part)
            self._place(submission, part.first, batch, known=False)
        self.front_stats.on_submit(len(batch), batch.num_tokens)

    def _new_batch(self, submission: Submission, part: TokenSlice) -> RequestBatch:
        batch = RequestBatch(
            self._next_id, part.token_ids, part.lengths, submission.params, part.type_ids,
            part.key_lens, submission.background, part.media, part.images,
        )  # fmt: skip
        self._next_id += len(batch)
        submission.num_tokens[part.first : part.first + len(batch)] = part.lengths
        return batch

    def _place(self, submission: Submission, row0: int, batch: RequestBatch, *, known: bool):
        """Route a batch (lock held); ``known``: the call already lists it (a requeued one)."""
        serving = [slot for slot in self._slots if slot.state == State.OK]
        if not serving:  # every replica is restarting: the first one back takes it
            if not known:
                submission.batches.append(batch)
            self._backlog.append(Owner(submission, row0, batch))
            return
        loads = np.fromiter((s.outstanding for s in serving), np.int64, len(serving))
        for k, lo, hi in split_rows(batch.lengths, loads, self._min_split):
            whole = lo == 0 and hi == len(batch)
            piece = batch if whole else batch.rows(batch.first_id + lo, lo, hi)
            if not known or not whole:
                submission.batches.append(piece)
            self._assign(serving[k], submission, row0 + lo, piece)

    def _assign(self, slot: Slot, submission: Submission, row0: int, batch: RequestBatch):
        slot.owners.add(submission, row0, batch)
        slot.outstanding += batch.num_tokens
        work = Work(
            batch.first_id, batch.token_ids, batch.lengths, batch.params, batch.type_ids,
            batch.key_lens, batch.background, submission.client, batch.media, batch.images,
        )  # fmt: skip
        slot.serving_proc().post(work)

    def cancel(self, submission: Submission) -> None:
        with self._lock:
            for slot in self._slots:
                dropped = []
                for batch in submission.batches:
                    owner = slot.owners.pop(batch.first_id)
                    if owner is not None:
                        slot.outstanding -= slot.unfinished_tokens(owner)
                        self.front_stats.on_abort(owner.remaining)
                        dropped.append(batch.first_id)
                if dropped and slot.proc is not None:
                    slot.proc.post(Abort(tuple(dropped)))
            self._backlog = [o for o in self._backlog if o.submission is not submission]

    # -- results and failures (reader threads) -------------------------------------------------

    def _on_report(self, proc: ReplicaHandle, report: Report) -> None:
        slot = self._slots[proc.index]
        deliveries = []
        with self._lock:
            if slot.proc is not proc:
                return  # a process already replaced
            slot.rates.add(report.snapshot)
            for result in report.results:
                owner = slot.owners.get(result.first_id)
                if owner is None:
                    continue  # aborted, or moved to another replica
                tokens = int(owner.batch.lengths[result.rows].sum())
                slot.outstanding -= tokens
                found = slot.owners.finish(owner.batch, owner.batch.first_id + result.rows)
                assert found is not None, "its owner was found just above"
                deliveries.append((found, result.values, tokens, result.replica_s))
            self._follow_health(slot, report.snapshot.health)
        for (submission, rows), values, tokens, replica_s in deliveries:
            self.front_stats.on_finish(len(rows), tokens)
            submission.remote_s = replica_s  # before the outputs: they may finish the call
            if isinstance(values, list):
                submission.put_tokens(rows, values)
            else:
                submission.put_vectors(rows, values)

    def _follow_health(self, slot: Slot, health: str) -> None:
        """A replica's own engine restarts a failed stage (lock held): its work moves to the
        replicas that serve meanwhile, and it takes new work once it is whole again."""
        if health == "degraded" and slot.state == State.OK:
            slot.state = State.HEALING
            others = any(s.state == State.OK for s in self._slots)
            log.warning(
                "replica %d is restarting a failed stage%s", slot.index,
                "; its unfinished work runs on the others" if others else "",
            )  # fmt: skip
            if others:
                self._move(slot, abort=True)
        elif health == "ok" and slot.state == State.HEALING:
            slot.state = State.OK
            log.warning("replica %d is whole again", slot.index)
            self._drain_backlog()

    def _on_lost(self, proc: ReplicaHandle, cause: BaseException) -> None:
        with self._lock:
            slot = self._slots[proc.index]
            if slot.proc is not proc or self._stop:
                return
            slot.error = cause
            slot.state = State.RESTARTING  # takes no work from here on
            slot.retire_process()
            slot.proc = None
            self.front_stats.on_error(cause)
            unfinished = slot.owners.num_unfinished
            others = any(s.state == State.OK for s in self._slots)
            where = "run on the other replicas" if others else "wait for a replica to come back"
            log.warning("%s; its %d unfinished inputs %s", cause, unfinished, where)
            self._move(slot, abort=False)
            self._schedule_restart(slot)

    def _move(self, slot: Slot, *, abort: bool) -> None:
        """Every unfinished row the replica holds runs elsewhere (lock held)."""
        old = slot.owners.first_ids()
        if not old:
            return
        _, self._next_id = slot.owners.requeue(self._next_id)  # new ids, same calls and rows
        moved = slot.owners.take_all()
        slot.outstanding = 0
        if abort and slot.proc is not None:
            slot.proc.post(Abort(tuple(old)))
        self.front_stats.on_retry(sum(len(o.batch) for o in moved))
        for owner in moved:
            self._place(owner.submission, owner.row0, owner.batch, known=True)

    def _drain_backlog(self) -> None:
        backlog, self._backlog = self._backlog, []
        for owner in backlog:
            self._place(owner.submission, owner.row0, owner.batch, known=True)

    def _schedule_restart(self, slot: Slot) -> None:
        """Start the replica again after the policy's backoff, or give up on it (lock held)."""
        delay = self._restart_delay(slot)
        if delay is None:
            slot.state = State.FAILED
            why = (
                f"after {slot.policy.limit} restarts in {slot.policy.window_s:.0f} s"
                if slot.policy.limit
                else "(restarts are off: stage_restarts=0)"
            )
            log.error("replica %d failed (%s); giving up on it %s", slot.index, slot.error, why)
            if all(s.state == State.FAILED for s in self._slots):
                threading.Thread(target=self._die, name="pipepool-replicas-dead").start()
            return
        slot.state = State.RESTARTING
        self._restarting = [t for t in self._restarting if t.is_alive()]
        thread = threading.Thread(
            target=self._restart, args=(slot, delay), name=f"replica-{slot.index}-restart"
        )
        self._restarting.append(thread)
        thread.start()

    def _restart_delay(self, slot: Slot) -> float | None:
        """Seconds until the replica is started again; None: give up on it."""
        return slot.policy.on_failure(time.monotonic())

    def _restart(self, slot: Slot, delay: float) -> None:
        block_stop_signals()
        with self._lock:
            if self._lock.wait_for(lambda: self._stop, timeout=delay):
                return
        log.warning("%s: " + self._restart_message, self._model, slot.index)
        proc = None
        try:
            proc = self._start_replica(slot.placement, cancelled=lambda: self._stop)
            proc.wait_ready(cancelled=lambda: self._stop)
        except BaseException as exc:
            if proc is not None:
                proc.kill()
            with self._lock:
                if not self._stop:
                    slot.error = exc
                    log.warning("replica %d did not start: %s", slot.index, exc)
                    self._schedule_restart(slot)
            return
        with self._lock:
            if self._stop:
                proc.kill()
                return
            slot.proc = proc
            slot.restarts += 1
            slot.state = State.OK
            self._drain_backlog()
        log.warning("replica %d is back (pid %d)", slot.index, proc.pid)

    def _die(self) -> None:
        with self._lock:
            causes = "; ".join(f"replica {s.index}: {s.error}" for s in self._slots)
            self._dead = EngineDeadError(
                f"all {len(self._slots)} replicas failed and were given up on ({causes})"
            )
            callbacks, self._on_death = self._on_death, []
        log.error("%s", self._dead)
        # Callbacks first, as LocalPipeline does: a caller whose call fails with the cause may
        # look for what they did at once (the server's health, a test's record).
        for fn in callbacks:
            fn(self._dead)
        self._fail_pending(self._dead)

    def _fail_pending(self, exc: BaseException) -> None:
        if not isinstance(exc, PipepoolError):
            exc = EngineDeadError(f"engine stopped: {exc!r}")
        with self._lock:
            owners = [o for slot in self._slots for o in slot.owners.take_all()]
            owners += self._backlog
            self._backlog = []
            for slot in self._slots:
                slot.outstanding = 0
        for owner in owners:
            owner.submission.fail(exc)

    def raise_if_dead(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine is dead: {self._dead}") from self._dead
        if self._closed:
            raise EngineDeadError("engine is closed")
