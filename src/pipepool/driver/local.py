"""``LocalPipeline``: one pipeline's scheduler, executor and loop thread, behind the Engine.

Calls from any thread put request batches into an inbox (``enqueue``); one loop thread owns the
scheduler and the executor, keeps up to ``executor.depth`` plans in flight, and writes each
step's outputs into the calls' results (``Submission``).

When a stage process dies, the loop heals the pipeline: it starts the stages again and runs
every unfinished request once more (pooling is a pure function of a prompt, so callers see a
delay, not an error), within ``RestartPolicy``'s bounds. A failure it cannot heal (a divergence,
a stage in this process, too many restarts) fails every pending and later call with the cause.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np

from ..config import EngineConfig
from ..core.kv_blocks import BlockAllocator
from ..core.plan import StepPlan, StepResult
from ..core.priority import turn_of
from ..core.request import RequestBatch
from ..core.restarts import RestartPolicy
from ..core.scheduler import Ledger, Scheduler
from ..core.stats import EngineStats
from ..core.submission import Submission
from ..errors import EngineDeadError, PipepoolError, StageFailure, StateDivergence
from ..intake.inputs import TokenSlice
from ..models.between_layers import hooked
from ..parallel.executor import Executor
from ..parallel.launch import deployment_for, start_executor
from ..runtime import switch_interval
from ..runtime.signal_mask import block_stop_signals
from ..tracing.driver import DriverTrace
from ..tracing.recorder import ProcessTrace, now
from .delivery import deliver
from .inbox import AbortCall, AddBatch, GatherTrace, InboxMessage
from .owners import Owners
from .pacing import IntakePacer
from .probe import probe_call
from .shared_steps import SharedSteps
from .watchdog import StepWatchdog

if TYPE_CHECKING:
    from ..stage.runner import StageRunner

log = logging.getLogger("pipepool")
_CLOSE_JOIN_S = 0.3


def _largest(inflight: deque[tuple[StepPlan, float]]) -> int:
    """The tokens of the largest plan in flight (0: none)."""
    return max((plan.num_tokens for plan, _ in inflight), default=0)


def _nothing() -> None:
    """After a slice is enqueued: nothing to wait for."""


class LocalPipeline:
    """One pipeline of stages (in this process, or one process per stage) driven by a loop
    thread of its own.

    Owns the scheduler (touched by the loop thread only), the executor and the owners of every
    unfinished request. Callers on any thread ``enqueue`` token batches and ``cancel`` calls;
    results are written into their ``Submission`` by the loop thread. Once it fails for good
    (or is closed) every pending and later call fails with ``EngineDeadError``.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.deployment = deployment_for(config)
        d = self.deployment
        self.stats = EngineStats(d.num_stages)
        self._scheduler = self._new_scheduler()
        # The step timeline (config.trace): None when off. Requests for the stages' spans wait
        # in _trace_wanted until no plan is in flight.
        self._trace = DriverTrace() if config.trace else None
        self._trace_wanted: list[Future] = []
        self._closed = True  # until the stages run, close() has nothing to stop
        self._executor: Executor = start_executor(d)  # last: it starts processes
        self._restarts = RestartPolicy(config.stage_restarts)
        self._next_id = 0
        self._owners = Owners()  # which call each batch's results go to
        self._inbox: deque[InboxMessage] = deque()
        lock = threading.RLock()
        self._wake = threading.Condition(lock)  # the loop's: work arrived, or stop
        self._pacer = IntakePacer(
            lock, d.max_num_batched_tokens, d.overlap_steps,
            ended=lambda: self._stop or self._dead is not None,
        )  # fmt: skip
        # Short steps while light calls share the pipeline, where steps do not overlap.
        self._shared_steps = SharedSteps(d.max_num_batched_tokens, enabled=not d.overlap_steps)
        # Light calls' steps between two layers of a long one (``_light_step``): where this
        # thread computes the one stage (CPU) of an encoder, and no trace follows the steps.
        self._between_layers = not (d.overlap_steps or d.causal or d.num_stages > 1 or config.trace)
        self._nested_s = 0.0  # time the step in flight spent on light steps inside it
        # The step in flight's expected end, and when a light call was first seen waiting
        # during it (perf_counter times; ``_light_step``).
        self._light_end = 0.0
        self._light_seen: float | None = None
        self._dead: BaseException | None = None
        self._restarting = False  # the loop is starting a failed pipeline again
        self._on_death: list[Callable[[BaseException], None]] = []
        self._closed = False
        self._stop = False
        self._executor.set_failure_listener(self._wake_loop)
        # Only stage processes of ours can be killed and started again when they hang.
        timeout = config.step_timeout_s if self._executor.can_restart else 0.0
        self._watchdog = StepWatchdog(timeout, self._on_hung)
        self._lowered_switch = switch_interval.lower(config.switch_interval_ms / 1000)
        self._thread = threading.Thread(target=self._loop, name="pipepool-engine", daemon=True)
        self._thread.start()

    def _new_scheduler(self) -> Scheduler:
        d = self.deployment
        blocks = BlockAllocator(d.num_kv_blocks, self.config.block_size) if d.causal else None
        return Scheduler(
            max_num_batched_tokens=d.max_num_batched_tokens,
            max_num_seqs=d.max_num_seqs,
            chunked=d.causal,
            blocks=blocks,
            verify_state=self.config.verify_state,
        )

    # -- what the Engine asks of its pipeline ---------------------------------------------------

    @property
    def tracing(self) -> bool:
        return self._trace is not None

    @property
    def runners(self) -> list[StageRunner]:
        """The stage runners in this process (stage 0 of a multi-process pipeline, every stage
        of an in-process one), for memory figures."""
        return list(self._executor.local_runners)

    @property
    def light_tokens(self) -> int:
        """The tokens of a light call (``SharedSteps.light_tokens``): at most that many, it
        may run in steps of its own beside large calls."""
        return self._shared_steps.light_tokens

    @property
    def kv_blocks_free(self) -> int | None:
        """Free KV-cache blocks now (None for bidirectional models, which keep no KV cache).
        Safe from any thread: the loop thread owns the allocator, this only reads a length."""
        blocks = self._scheduler.blocks
        return None if blocks is None else blocks.num_free

    @property
    def kv_blocks_total(self) -> int:
        return self.deployment.num_kv_blocks

    @property
    def health(self) -> str:
        """ok | degraded (a stage died; the pipeline is being restarted, calls wait) | dead |
        closed."""
        if self._closed:
            return "closed"
        if self._dead is not None:
            return "dead"
        if self._restarting or self._executor.failure is not None:
            return "degraded" if self._may_heal() else "dead"
        return "ok"

    @property
    def cause_of_death(self) -> BaseException | None:
        return self._dead

    def replica_status(self) -> list:
        return []  # one pipeline, no replicas

    def add_death_callback(self, fn: Callable[[BaseException], None]) -> None:
        with self._wake:
            dead = self._dead
            if dead is None:
                self._on_death.append(fn)
        if dead is not None:
            fn(dead)

    def wait_until_compiled(self, timeout: float | None) -> bool:
        if not self.deployment.compile_in_background:
            return True  # compiled before the pipeline was ready, or not at all
        if not self._executor.wait_compiled(timeout):
            return False
        self._watchdog.compiled()  # the compiled bodies' first runs may be slow
        self._run_probe()  # the stages install the compiled bodies between two steps: this one
        return True

    def stage_busy_s(self) -> list[float]:
        """Stages report with their step results, device time only once the device got
        there, so a one-token step brings every figure up to date first."""
        self._run_probe()
        return list(self.stats.stage_busy_s)

    def _run_probe(self) -> None:
        submission, part = probe_call(self.deployment, self.cancel)
        self.enqueue(submission, part)
        submission.result()

    def gather_trace(self, timeout: float | None) -> list[list[ProcessTrace]]:
        """Every process's spans so far, one list (one pipeline); waits for the plans in
        flight to finish, while new plans wait."""
        wanted: Future = Future()
        with self._wake:
            self.raise_if_dead()
            self._inbox.append(GatherTrace(wanted))
            self._wake.notify()
        return [wanted.result(timeout=timeout)]

    def close(self, join_timeout: float = _CLOSE_JOIN_S) -> None:
        """Stop the loop and every stage process now; pending calls fail with
        EngineDeadError("engine closed"). Stages are not asked to finish the steps in flight:
        nothing they would still compute is wanted, so they exit at once."""
        with self._wake:
            first = not self._closed
            self._closed = True
            self._stop = True
            self._watchdog.stop()
            self._wake.notify()
            self._pacer.release_waiters()
        if first:
            self._executor.abort()  # a loop waiting on a stage's answer fails over at once
        # The loop leaves at its next check of _stop; one still inside a long step on the
        # driver's own stage is not waited for longer (it is a daemon, and delivers nothing).
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=join_timeout)
        if not first:
            return
        self._fail_pending(EngineDeadError("engine closed"))
        self._executor.shutdown()
        if self._lowered_switch:
            self._lowered_switch = False
            switch_interval.restore()

    def cancel(self, submission: Submission) -> None:
        with self._wake:
            self._inbox.append(AbortCall(submission))
            self._wake.notify()

    def slice_intake(self) -> contextlib.AbstractContextManager[Callable[[], object]]:
        """Around the enqueueing of a call whose inputs come in several slices: yields what
        the caller runs after each slice to keep out of the loop thread's way
        (``IntakePacer.intake``); nothing to wait for on the loop thread itself."""
        if threading.current_thread() is self._thread:
            return contextlib.nullcontext(_nothing)
        return self._pacer.intake(self._wake)

    def _take_inbox(self) -> deque:
        with self._wake:
            inbox, self._inbox = self._inbox, deque()
        return inbox

    def _next_slice_arrived(self, timeout_s: float = 0.002) -> bool:
        """Whether work arrived while waiting (``timeout_s`` at most, and only while a call
        is still enqueueing slices) for the slice that a call is preparing."""
        with self._wake:
            self._wake.wait_for(
                lambda: self._inbox or self._stop or not self._pacer.slicing, timeout_s
            )
            return bool(self._inbox)

    def enqueue(self, submission: Submission, part: TokenSlice) -> None:
        """Queue a slice of a call's prompts (validated, tokenised) for the loop thread."""
        rows = None  # the call's row of each batch row, where not part.first onwards
        if self.deployment.length_sorted and len(part.lengths) > 1:
            part, order = part.longest_first()
            rows = part.first + order
        with self._wake:  # under the lock, so a request cannot slip in after the engine died
            self.raise_if_dead()
            batch = RequestBatch(
                self._next_id, part.token_ids, part.lengths, submission.params, part.type_ids,
                part.key_lens, submission.background, part.media, part.images,
            )  # fmt: skip
            self._next_id += len(batch)
            if submission.batches:  # a later slice: it takes turns as part of its call
                batch.call = submission.batches[0].call
            elif submission.client is not None:  # its client's calls take one turn
                batch.call = turn_of(submission.client)
            if rows is None:
                submission.num_tokens[part.first : part.first + len(batch)] = part.lengths
            else:
                submission.num_tokens[rows] = part.lengths
            submission.batches.append(batch)
            self._pacer.backlog_tokens += batch.num_tokens
            self._owners.add(submission, part.first, batch, rows)
            self._inbox.append(AddBatch(batch))
            self._wake.notify()
        self.stats.on_submit(len(batch), batch.num_tokens)

    # -- the loop ---------------------------------------------------------------------------

    def _loop(self) -> None:
        block_stop_signals()  # Ctrl-C is the main thread's (and so are the threads we start)
        while True:
            try:
                self._serve()
                return  # closed
            except BaseException as exc:
                if self._stop:
                    return  # close() killed the stages under us; it fails what is pending
                cause = self._heal(exc)
                if cause is not None:  # nothing more can be trusted
                    self._die(cause)
                    return
            # Healed. The failed pipeline's sockets and threads hang in a reference cycle (the
            # failure's traceback holds the frames that used them): free them now, not at
            # some later collection.
            gc.collect()

    def _serve(self) -> None:
        """Schedule, execute and deliver until closed; raises what failed the pipeline."""
        inflight: deque[tuple[StepPlan, float]] = deque()  # (plan, when it was submitted)
        executor, scheduler = self._executor, self._scheduler
        self._watchdog.reset()
        while True:
            with self._wake:
                while not (
                    self._inbox
                    or self._stop
                    or inflight
                    or scheduler.has_schedulable()
                    or executor.failure is not None
                    or self._trace_wanted
                ):
                    self._wake.wait()
                if self._stop:
                    return
                inbox = self._take_inbox()
            executor.check_alive()
            self._apply_inbox(inbox)
            tr = self._trace  # None unless tracing: then nothing below records anything
            # A trace gathered waits for the plans in flight; no new plan starts meanwhile.
            gathering = tr is not None and bool(self._trace_wanted)
            while len(inflight) < executor.depth and not gathering:
                if inflight and self._pacer.short_of_a_step() and self._next_slice_arrived():
                    self._apply_inbox(self._take_inbox())
                t0 = now() if tr is not None else 0
                plan = scheduler.schedule(self._step_budget(scheduler, bool(inflight)))
                if plan is None:
                    break
                submitted = time.perf_counter()
                if tr is not None:
                    tr.submitted(t0)
                    t0 = tr.span("schedule", t0, plan)
                # Stage 0 may run here, and the hand-over waits on the next stages: bounded too.
                self._watchdog.waiting(max(plan.num_tokens, _largest(inflight)))
                self._nested_s = 0.0
                self._light_window(plan)
                try:
                    with hooked(self._light_step if self._hosts_light_steps(plan) else None):
                        executor.submit(plan)
                finally:
                    self._watchdog.waited()
                self._handed_over(plan)
                if tr is not None:
                    tr.span("submit", t0, plan)
                inflight.append((plan, submitted))
                self.stats.on_plan(plan)
            if inflight:
                t0 = now() if tr is not None else 0
                self._watchdog.waiting(_largest(inflight))
                try:
                    result = executor.collect()
                finally:
                    self._watchdog.waited()
                self._watchdog.collected()
                plan, submitted = inflight.popleft()
                if tr is not None:
                    t0 = tr.span("wait result", t0, plan)
                ledger = scheduler.update(plan, result, last_stage=executor.num_stages - 1)
                # Without the light steps computed inside it: their time is their own.
                took = time.perf_counter() - submitted - self._nested_s
                self._shared_steps.timed(plan.num_tokens, took)
                self.stats.on_result(plan, result, took)
                self._deliver(result, ledger)
                if tr is not None:
                    end = tr.span("deliver", t0, plan)
                    if not inflight and not scheduler.has_schedulable():
                        tr.drained(end)  # the pipeline ran dry: a busy period ends
            elif gathering:
                self._answer_trace()
            self.stats.set_queue(
                scheduler.num_waiting, scheduler.num_waiting + scheduler.num_admitted
            )

    def _hosts_light_steps(self, plan: StepPlan) -> bool:
        """Whether light calls may have steps between two layers of ``plan``: one longer than
        a short step (``SharedSteps.short_tokens``), on a pipeline that can. A light call that
        arrives during a short step waits for its end and shares the next one with the others
        that came meanwhile: one step for them all."""
        return self._between_layers and plan.num_tokens > self._shared_steps.short_tokens()

    def _light_window(self, plan: StepPlan) -> None:
        """``plan`` is about to be computed: when it will end, as far as the speed measured
        tells (light steps inside it push that back), and no light call seen waiting yet."""
        compute = self._shared_steps.expected_s(plan.num_tokens)
        self._light_end = time.perf_counter() + (float("inf") if compute is None else compute)
        self._light_seen = None

    def _light_step(self) -> None:
        """Between two layers of a step this thread computes: a step of the light calls that
        arrived meanwhile (``Scheduler.schedule_light``), computed and delivered before the
        long step goes on, so a one-word request waits for a layer, not for a whole step
        (an encoder window of 256 tokens: ~70 ms of two CPU cores, a layer of it ~12 ms;
        issue 57). Encoder requests live one step, so a plan inside another changes no state
        of the other's. A step of their own has a fixed cost (~5 ms for one word) that the
        long call pays, so light calls get one only where waiting for the long step's end
        would keep them more than ``step_s`` (as a short step would, ``SharedSteps``): the
        ones that come near its end share the next step, unless it runs late."""
        if any(r.compiling is not None for r in self._executor.local_runners):
            return
        shared, now = self._shared_steps, time.perf_counter()
        if self._inbox:
            self._apply_inbox(self._take_inbox())
            if self._light_seen is None and self._scheduler.light_call_to_run(shared.light_tokens):
                self._light_seen = now  # (it came within the layer just computed)
        # Left for the next step, it would wait from when it was seen to the long step's end,
        # or, once the step runs past the end its speed gave (other work took the cores),
        # to a later boundary at least.
        ends = max(self._light_end, now)
        if self._light_seen is None or ends - self._light_seen <= shared.step_s:
            return
        plan = self._scheduler.schedule_light(shared.light_tokens, shared.short_tokens())
        self._light_seen = None
        if plan is None:
            return
        started = time.perf_counter()
        with hooked(None):  # no step inside this one
            self._handed_over(plan)
            self.stats.on_plan(plan)
            self._executor.submit(plan)
            result = self._executor.collect()
        ledger = self._scheduler.update(plan, result, last_stage=self._executor.num_stages - 1)
        ended = time.perf_counter()
        took = ended - started
        self._nested_s += took
        self._light_end += took  # the long step ends that much later
        shared.light_served(ended)
        self.stats.on_result(plan, result, took)
        self._deliver(result, ledger)

    def _step_budget(self, scheduler: Scheduler, busy: bool) -> int | None:
        """The next step's token budget (None: the whole budget): smaller for a step that
        starts an idle pipeline (``IntakePacer.idle_step_tokens``) and while light calls share
        the pipeline (``SharedSteps``)."""
        budgets = (
            None if busy else self._pacer.idle_step_tokens(),
            self._shared_steps.budget(scheduler, time.perf_counter()),
        )
        return min((b for b in budgets if b is not None), default=None)

    def _handed_over(self, plan: StepPlan) -> None:
        """A plan is with the stages: its tokens leave the backlog (``IntakePacer``)."""
        with self._wake:
            self._pacer.handed_over(plan.num_tokens)

    def _heal(self, failure: BaseException) -> BaseException | None:
        """Start the failed pipeline again and queue every unfinished request once more.
        Returns None when healed (or closing), else the cause to die of."""
        while self._may_heal() and isinstance(failure, StageFailure):
            if isinstance(failure, StateDivergence):
                return failure  # a logic error: a fresh pipeline would diverge again
            delay = self._restarts.on_failure(time.monotonic())
            if delay is None:
                log.error("pipeline failed again (%s); giving up after %d restarts", failure,
                          self._restarts.limit)  # fmt: skip
                return failure
            with self._wake:
                self._restarting = True
            self.stats.on_error(failure)
            log.warning("pipeline failed (%s); restarting its stages in %.1f s", failure, delay)
            old = self._executor
            old.shutdown()
            self._requeue()
            with self._wake:
                if self._wake.wait_for(lambda: self._stop, timeout=delay):
                    return None
            try:
                executor = start_executor(
                    self.deployment, replacing=old, cancelled=lambda: self._stop
                )
            except BaseException as exc:
                if self._stop:
                    return None
                failure = exc
                continue
            executor.set_failure_listener(self._wake_loop)
            self.stats.on_restart()
            with self._wake:
                self._executor = executor
                self._restarting = False  # every stage loaded and connected again
            log.warning("pipeline restarted; %d requests to run again", self._owners.num_unfinished)
            return None
        return failure

    def _may_heal(self) -> bool:
        return self._restarts.limit > 0 and self._executor.can_restart

    def _requeue(self) -> None:
        """A fresh scheduler (every KV block free) holding the unfinished requests of every
        pending call, in their order (``Owners.requeue``)."""
        with self._wake:  # no call may slip a batch in between
            self._apply_inbox(self._take_inbox())  # aborts apply; additions are taken over below
            batches, self._next_id = self._owners.requeue(self._next_id)
            self._scheduler = self._new_scheduler()
            self._pacer.backlog_tokens = sum(batch.num_tokens for batch in batches)
            for batch in batches:
                self._scheduler.add(batch)
                self.stats.on_retry(len(batch))

    def _die(self, cause: BaseException) -> None:
        with self._wake:
            self._dead = cause
            self._restarting = False
            callbacks, self._on_death = self._on_death, []
            self._pacer.release_waiters()
        self.stats.on_error(cause)
        # Callbacks first: a caller whose call fails with the cause may look for them at once.
        for fn in callbacks:
            fn(cause)
        self._fail_pending(cause)
        self._executor.shutdown()

    def _on_hung(self, reason: str) -> None:
        """The watchdog's thread: a step is overdue. Killing the stages fails the loop's wait,
        and the loop heals the pipeline (or dies of it, past the restart limit)."""
        log.error("pipeline hung: %s", reason)
        self._executor.declare_hung(reason)

    def _wake_loop(self) -> None:
        with self._wake:
            self._wake.notify()

    def _answer_trace(self) -> None:
        """Every process's spans for the callers of ``write_trace`` (no plan is in flight)."""
        wanted, self._trace_wanted = self._trace_wanted, []
        try:
            # gather_trace is only asked of a pipeline that traces (Engine.write_trace checks).
            assert self._trace is not None, "tracing is off"
            traces = [self._trace.export(), *self._executor.gather_trace()]
        except BaseException as exc:
            for future in wanted:
                future.set_exception(exc)
            raise
        for future in wanted:
            future.set_result(traces)

    def _apply_inbox(self, inbox: deque[InboxMessage]) -> None:
        for message in inbox:
            if isinstance(message, AddBatch):
                self._scheduler.add(message.batch)
                continue
            if isinstance(message, GatherTrace):
                self._trace_wanted.append(message.future)
                continue
            for batch in message.submission.batches:  # a cancelled call: every batch of it
                owner = self._owners.pop(batch.first_id)
                if owner is not None:
                    unplanned = self._scheduler.abort(batch)
                    with self._wake:
                        self._pacer.backlog_tokens -= unplanned
                    self.stats.on_abort(owner.remaining)

    def _deliver(self, result: StepResult, ledger: Ledger) -> None:
        """Write the step's finished outputs into their calls' results, one slice per batch."""
        deliver(result, ledger, self._finish)

    def _finish(self, batch: RequestBatch, ids: np.ndarray) -> tuple[Submission, np.ndarray] | None:
        """(call, its rows) for finished requests of a batch; None if the call was cancelled
        (its rows were counted aborted then, so they are not counted finished)."""
        found = self._owners.finish(batch, ids)
        if found is not None:
            rows = ids - batch.first_id
            whole = len(rows) == len(batch.lengths)
            tokens = batch.num_tokens if whole else int(batch.lengths[rows].sum())
            self.stats.on_finish(len(rows), tokens)
        return found

    def _fail_pending(self, exc: BaseException) -> None:
        if not isinstance(exc, PipepoolError):
            exc = EngineDeadError(f"engine stopped: {exc!r}")
        with self._wake:
            owners = self._owners.take_all()
            wanted, self._trace_wanted = self._trace_wanted, []
            wanted += [m.future for m in self._inbox if isinstance(m, GatherTrace)]
        for owner in owners:
            owner.submission.fail(exc)
        for future in wanted:
            if not future.done():
                future.set_exception(exc)

    def raise_if_dead(self) -> None:
        if self._dead is None and self._executor.failure is not None and not self._may_heal():
            self._dead = self._executor.failure  # a stage died while the engine was idle
        if self._dead is not None:
            cause = self._dead
            if isinstance(cause, PipepoolError):
                raise EngineDeadError(f"engine is dead: {cause}") from cause
            raise EngineDeadError(f"engine is dead: {cause!r}") from cause
        if self._closed:
            raise EngineDeadError("engine is closed")
