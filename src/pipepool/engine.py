"""The Engine: the one object every front end (Python API, CLI, HTTP server) sits on.

Calls from any thread tokenise in the caller's thread and put request batches into an inbox;
one loop thread owns the scheduler and the executor, keeps up to ``executor.depth`` plans in
flight, and writes each step's outputs into the calls' results (``Submission``).

When a stage process dies, the loop heals the pipeline: it starts the stages again and runs
every unfinished request once more (pooling is a pure function of a prompt, so callers see a
delay, not an error), within ``RestartPolicy``'s bounds. A failure it cannot heal (a divergence,
a stage in this process, too many restarts) fails every pending and later call with the cause.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np

from . import switch_interval
from .config import EngineConfig, check_long_inputs
from .core.kv_blocks import BlockAllocator
from .core.plan import StepPlan, StepResult
from .core.request import PoolingParams, RequestBatch
from .core.restarts import RestartPolicy
from .core.scheduler import Ledger, Scheduler
from .core.stats import EngineStats
from .deployment import Deployment
from .errors import (
    EngineDeadError,
    InvalidInputError,
    PipepoolError,
    StageFailure,
    StateDivergence,
)
from .inputs import InputPreparer, TokenSlice
from .long_inputs import CombinedSubmission, split_windows, window_params
from .memory import bound_heap_growth
from .owners import Owners
from .parallel.executor import Executor
from .parallel.launch import deployment_for, start_executor
from .scoring import ScoringMethods, refuse_embedding
from .signal_mask import block_stop_signals
from .submission import Submission
from .tracing.driver import DriverTrace
from .tracing.recorder import now

if TYPE_CHECKING:
    from .tracing import TraceSummary

log = logging.getLogger("pipepool")
_CLOSE_JOIN_S = 0.3
# At interpreter exit a loop thread still inside a step is waited for this long: the
# interpreter's teardown under a running torch op aborts the process (see _close_at_exit).
_EXIT_JOIN_S = 10.0
# The longest a caller enqueueing a call's slices waits for the backlog to fall below a step
# (``_slice_intake``): a bound, not a pace; the backlog falls at every step.
_PACE_S = 0.05
# A step that starts an idle pipeline holds at most this share of the step budget where steps
# overlap (``overlap_steps``, CUDA's default): the device starts sooner, and the next step, a
# whole one, is built while this one runs (W4 on the MiniLM shape on an H200, one engine, the
# start of a call as in 0c9a1b4 and as now: 29.2 against 28.6 ms a call; BENCHMARKS.md).
_IDLE_STEP_SHARE = 0.5
_open_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


def _nothing() -> None:
    """After a slice is enqueued: nothing to wait for."""


class Engine(ScoringMethods):
    """Embeds text or token ids with a pooling model, optionally split into pipeline stages;
    scores, reranks and classifies with a classifier (``ScoringMethods``).

    Every method is thread-safe and may be called concurrently; results come back in input
    order. Use as a context manager, or call ``close()``. Keyword options are the fields of
    ``EngineConfig`` (``max_num_batched_tokens``, ``pipeline_parallel_size``, ...);
    ``data_parallel_size=N`` gives the same API over N replica pipelines
    (``replicas.engine.ReplicatedEngine``).
    """

    def __new__(cls, model: str | None = None, **options) -> Engine:
        # data_parallel_size > 1: the same API over N replica pipelines (replicas/).
        return object.__new__(_engine_class(cls, options.get("data_parallel_size", 1)))

    def __init__(self, model: str | None = None, **options) -> None:
        self._init(EngineConfig.from_options(model=model, **options))

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        engine = object.__new__(_engine_class(cls, config.data_parallel_size))
        engine._init(config)
        return engine

    def _init(self, config: EngineConfig) -> None:
        self._closed = True  # until fully started, close() has nothing to stop
        bound_heap_growth()  # before the first large block: RSS stays flat however long we run
        self.config = config
        self.deployment: Deployment = deployment_for(config)
        d = self.deployment
        self.inputs = InputPreparer(d)
        self.stats = EngineStats(d.num_stages)
        self._scheduler = self._new_scheduler()
        # The step timeline (config.trace): None when off. Requests for the stages' spans wait
        # in _trace_wanted until no plan is in flight.
        self._trace = DriverTrace() if config.trace else None
        self._trace_wanted: list[Future] = []
        self._trace_written = False
        self._executor: Executor = start_executor(d)  # last: it starts processes
        self._restarts = RestartPolicy(config.stage_restarts)
        self._next_id = 0
        self._owners = Owners()  # which call each batch's results go to
        self._inbox: deque = deque()
        lock = threading.RLock()
        self._wake = threading.Condition(lock)  # the loop's: work arrived, or stop
        # A caller's, pacing a call's slices (_slice_intake): a step took from the backlog.
        self._room = threading.Condition(lock)
        self._backlog_tokens = 0  # enqueued, and not yet in a plan handed to the stages
        self._plans_handed_over = 0  # since the engine started (see _slice_intake)
        self._slicing = 0  # calls still enqueueing slices (see _slice_intake)
        self._dead: BaseException | None = None
        self._restarting = False  # the loop is starting a failed pipeline again
        self._on_death: list[Callable[[BaseException], None]] = []
        self._closed = False
        self._stop = False
        self._executor.set_failure_listener(self._wake_loop)
        self._lowered_switch = switch_interval.lower(config.switch_interval_ms / 1000)
        self._thread = threading.Thread(target=self._loop, name="pipepool-engine", daemon=True)
        self._thread.start()
        _open_engines.add(self)

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

    # -- public API -------------------------------------------------------------------------

    @property
    def model_path(self) -> str:
        return str(self.deployment.folder.path)

    def embed(
        self,
        inputs: str | Sequence[str] | Sequence[Sequence[int]],
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: str = "right",
        prompt_name: str | None = None,
        long_inputs: str | None = None,
    ) -> np.ndarray:
        """One vector per input, ``[n, dim]`` float32, in input order (``[0, dim]`` for no
        input)."""
        return self.submit(
            inputs,
            dimensions=dimensions,
            normalize=normalize,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
            prompt_name=prompt_name,
            long_inputs=long_inputs,
        ).result()

    def embed_tokens(
        self,
        inputs: str | Sequence[str] | Sequence[Sequence[int]],
        *,
        normalize: bool = False,
        truncate_prompt_tokens: int | None = None,
        truncation_side: str = "right",
        prompt_name: str | None = None,
        long_inputs: str | None = None,
    ) -> list[np.ndarray]:
        """Token embeddings (ALL pooling): one ``[len, hidden]`` float32 array per input."""
        return self.pool(
            inputs,
            pooling="all",
            normalize=normalize,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
            prompt_name=prompt_name,
            long_inputs=long_inputs,
        )

    def pool(self, inputs, *, pooling: str, **kwargs) -> list[np.ndarray]:
        """Any pooling (last | mean | cls | all) for a batch of inputs; blocks until done.
        One array per input; ``kwargs`` as for ``submit``."""
        return list(self.submit(inputs, pooling=pooling, **kwargs).result())

    # sentence-transformers' names, so code written for SentenceTransformer runs unchanged.

    def encode(
        self,
        sentences: str | Sequence[str],
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        output_value: str = "sentence_embedding",
        precision: str = "float32",
        convert_to_numpy: bool = True,
        convert_to_tensor: bool = False,
        normalize_embeddings: bool = False,
        prompt_name: str | None = None,
        truncate_dim: int | None = None,
    ):
        """``SentenceTransformer.encode``: a ``[n, dim]`` array (one ``[dim]`` vector for a
        single string), ``[0, dim]`` for an empty list. ``batch_size`` is accepted and unused:
        the engine batches by tokens (``max_num_batched_tokens``), not by count.
        ``normalize_embeddings=False`` keeps the model's own normalisation, as there.
        ``output_value="token_embeddings"`` gives one ``[len, hidden]`` array per input."""
        from .st_compat import encode

        return encode(
            self,
            sentences,
            show_progress_bar=show_progress_bar,
            output_value=output_value,
            precision=precision,
            convert_to_numpy=convert_to_numpy,
            convert_to_tensor=convert_to_tensor,
            normalize_embeddings=normalize_embeddings,
            prompt_name=prompt_name,
            truncate_dim=truncate_dim,
        )

    def get_embedding_dimension(self) -> int:
        """Size of one embedding (after any Dense head), as sentence-transformers says it."""
        return self.deployment.output_dim

    get_sentence_embedding_dimension = get_embedding_dimension  # its name before version 6

    def similarity(self, a, b) -> np.ndarray:
        """``[len(a), len(b)]`` similarities by the model's ``similarity_fn_name`` (cosine
        unless its sentence-transformers config says dot, euclidean or manhattan)."""
        from .st_compat import similarity

        st = self.deployment.folder.st
        return similarity(a, b, st.similarity_fn_name if st else None)

    def submit(
        self,
        inputs,
        *,
        pooling: str | None = None,
        dimensions: int | None = None,
        normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: str = "right",
        prompt_name: str | None = None,
        long_inputs: str | None = None,
    ) -> Submission | CombinedSubmission:
        """Validate, tokenise and enqueue; returns the call's future once every input is
        enqueued.

        Raises InvalidInputError naming the input if any input is bad; then nothing of the
        call stays queued (slices already enqueued are cancelled). Long lists are tokenised
        and enqueued a slice at a time, so the device starts on the first slice while this
        thread tokenises the next, paced by ``_slice_intake``.
        ``long_inputs`` overrides the engine's policy for inputs over max_model_len.
        """
        refuse_embedding(self.deployment)
        params = self.inputs.params(pooling or self.deployment.pooling, dimensions, normalize)
        policy = check_long_inputs(long_inputs or self.config.long_inputs)
        items = self.inputs.items(inputs)
        slices = self.inputs.token_slices(
            items,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
            prompt_name=prompt_name,
            long_inputs=policy,
        )
        if (
            not isinstance(inputs, str)
            and isinstance(inputs, (Sequence, np.ndarray))
            and not len(inputs)
        ):
            return self._new_submission(params, 0)  # already done: an empty result
        first = next(slices)  # options (and every text) validated before anything is enqueued
        if policy == "chunk":
            return self._submit_windows(params, [first, *slices])
        submission = self._new_submission(params, len(items))
        more = len(first.lengths) < len(items)
        try:
            with self._slice_intake() if more else contextlib.nullcontext(_nothing) as enqueued:
                for part in itertools.chain([first], slices):
                    self._enqueue(submission, part)
                    if part.first + len(part.lengths) < len(items):
                        enqueued()  # before preparing the next slice
        except BaseException:
            submission.cancel()
            raise
        return submission

    @contextlib.contextmanager
    def _slice_intake(self) -> Iterator[Callable[[], object]]:
        """Around the enqueueing of a call whose inputs come in several slices. Both threads
        need the GIL, so the caller preparing slices contends with the loop thread preparing
        steps; this yields what the caller runs after each slice it enqueues, to keep out of
        the loop's way while the loop has enough to do:

        - after the first: a wait (5 ms at most) until the loop thread has handed a step to
          the stages. Preparing the next slices meanwhile only delayed the device's first
          kernel: 4.4 ms of an 8192-query call's 37 ms on an H200.
        - after each: a wait (``_PACE_S`` at most) while the backlog (tokens enqueued and in
          no plan handed to the stages yet) holds a whole step. Preparing all slices at once
          slowed the preparation of the second step so much that the device waited 2.2 ms
          for it (BENCHMARKS.md, issue 10, ninth pass).

        And while the call lasts, the loop thread, with room for another step in flight and
        less than a step to schedule (``_short_of_a_step``), waits for the next slice
        (``_next_slice_arrived``) before it schedules, so step k+1 is built while the device
        runs step k (blocking on the step in flight left the device idle 2.5 and 2.1 ms before
        such a call's second and third steps) and holds a whole step where the call has one."""
        if threading.current_thread() is self._thread:  # nothing to wait for
            yield _nothing
            return
        with self._wake:
            self._slicing += 1
            handed_before = self._plans_handed_over
        first = True
        step = self.deployment.max_num_batched_tokens

        def ended() -> bool:
            return self._stop or self._dead is not None

        def enqueued() -> None:
            nonlocal first
            with self._wake:
                if first:
                    first = False
                    self._room.wait_for(
                        lambda: self._plans_handed_over > handed_before or ended(), 0.005
                    )
                self._room.wait_for(lambda: self._backlog_tokens < step or ended(), _PACE_S)

        try:
            yield enqueued
        finally:
            with self._wake:
                self._slicing -= 1
                self._wake.notify()

    def _short_of_a_step(self) -> bool:
        """Whether a call is still enqueueing slices while less than a step's budget is
        queued: a step scheduled now would be short (the rest of a slice) while its next slice
        is being prepared. A short step costs the host as much as a full one, and a small
        model's short step costs the device less than that: the device then waits for the
        host (W4 on MiniLM, its layers stubbed out on the CPU and steps overlapping, took steps
        of 22k, 44k, 66k, 23k, 66k, 25k, ... tokens; BENCHMARKS.md, issue 10, tenth pass)."""
        return bool(self._slicing) and self._backlog_tokens < self.deployment.max_num_batched_tokens

    def _idle_step_tokens(self) -> int | None:
        """The budget of a step scheduled while no step is in flight (``_IDLE_STEP_SHARE``);
        None (the whole budget) where steps do not overlap (the CPU: the driver computes stage
        0 itself, so nothing of the next step is built while a step runs)."""
        if not self.deployment.overlap_steps:
            return None
        return int(self.deployment.max_num_batched_tokens * _IDLE_STEP_SHARE)

    def _take_inbox(self) -> deque:
        with self._wake:
            inbox, self._inbox = self._inbox, deque()
        return inbox

    def _next_slice_arrived(self, timeout_s: float = 0.002) -> bool:
        """Whether work arrived while waiting (``timeout_s`` at most, and only while a call
        is still enqueueing slices) for the slice that a call is preparing."""
        with self._wake:
            self._wake.wait_for(lambda: self._inbox or self._stop or not self._slicing, timeout_s)
            return bool(self._inbox)

    def _submit_windows(
        self, params: PoolingParams, parts: list[TokenSlice]
    ) -> Submission | CombinedSubmission:
        """long_inputs="chunk": inputs over max_model_len become several requests."""
        token_ids = np.concatenate([p.token_ids for p in parts])
        lengths = np.concatenate([p.lengths for p in parts])
        d = self.deployment
        size = min(d.max_model_len, d.kv_cache_tokens) if d.causal else d.max_model_len
        windows = split_windows(token_ids, lengths, size)
        if len(windows.lengths) == len(lengths):  # nothing to split
            return self.submit_tokens(token_ids, lengths, params)
        inner = self.submit_tokens(token_ids, windows.lengths, window_params(params))
        return CombinedSubmission(inner, windows, params)

    def submit_tokens(
        self,
        token_ids: np.ndarray,
        lengths: np.ndarray,
        params: PoolingParams,
        type_ids: np.ndarray | None = None,
    ) -> Submission:
        """Enqueue prompts already validated by ``self.inputs`` (back to back), with the token
        type ids of pair inputs if any."""
        submission = self._new_submission(params, len(lengths))
        self._enqueue(submission, TokenSlice(0, token_ids, lengths, type_ids))
        return submission

    def tokenize(self, inputs, **kwargs) -> list[np.ndarray]:
        """Token ids per input, as ``submit`` would enqueue them (truncation included)."""
        kwargs.setdefault("long_inputs", self.config.long_inputs)
        return self.inputs.prepare(inputs, **kwargs)

    def wait_until_compiled(self, timeout: float | None = None) -> bool:
        """Block until every stage computes with its compiled layer bodies; False if that
        takes longer than ``timeout`` seconds. Where ``compile`` is left to the engine it is
        ready, and serves, while it compiles (README, "Start-up"); a benchmark waits here."""
        if not self.deployment.compile_in_background:
            return True  # compiled before the engine was ready, or not at all
        if not self._executor.wait_compiled(timeout):
            return False
        self._one_token_step()  # the stages install them between two steps: this one
        return True

    def stage_busy_s(self) -> list[float]:
        """Seconds each stage has spent computing so far (for idle fractions). Stages report
        with their step results, device time only once the device got there, so a one-token
        step brings every figure up to date first."""
        self._one_token_step()
        return list(self.stats.stage_busy_s)

    def _one_token_step(self) -> None:
        """Run one step of a one-token request through every stage, and wait for it."""
        params = self.inputs.params("last", None, False)
        self.submit_tokens(np.zeros(1, np.int64), np.ones(1, np.int64), params).result()

    @property
    def kv_blocks_free(self) -> int | None:
        """Free KV-cache blocks now (None for encoders, which keep no KV cache).

        Safe from any thread: the loop thread owns the allocator, this only reads a length.
        """
        blocks = self._scheduler.blocks
        return None if blocks is None else blocks.num_free

    @property
    def kv_blocks_total(self) -> int:
        """KV-cache blocks of the pipeline (0 for encoders)."""
        return self.deployment.num_kv_blocks

    @property
    def is_alive(self) -> bool:
        """False once closed, or once the pipeline failed for good (even with no request in
        flight); True while a failed pipeline is being restarted."""
        return self.health in ("ok", "degraded")

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

    def add_death_callback(self, fn: Callable[[BaseException], None]) -> None:
        """``fn(cause)`` once the engine fails for good (not on ``close()``); called on the
        loop thread, or at once if it is dead already."""
        with self._wake:
            dead = self._dead
            if dead is None:
                self._on_death.append(fn)
        if dead is not None:
            fn(dead)

    def write_trace(
        self,
        path: str | None = None,
        *,
        since_ns: int | None = None,
        until_ns: int | None = None,
        timeout: float | None = 300.0,
    ) -> TraceSummary:
        """Write the step timeline so far to ``path`` (default: ``config.trace``) as Chrome
        trace events and return where each stage's time went. ``since_ns`` / ``until_ns``
        (``time.monotonic_ns()`` of this process) keep only that window. Waits for the plans
        in flight to finish; new plans wait meanwhile. Tracing must be on (``trace=``)."""
        from .tracing import summarize
        from .tracing.chrome import write_chrome_trace

        if self._trace is None:
            raise InvalidInputError("tracing is off: start the engine with trace=FILE.json")
        wanted: Future = Future()
        with self._wake:
            self._raise_if_dead()
            self._inbox.append(("trace", wanted))
            self._wake.notify()
        traces = wanted.result(timeout=timeout)
        write_chrome_trace(path or self.config.trace, traces, since_ns, until_ns)
        self._trace_written = True
        return summarize(traces, since_ns, until_ns)

    def close(self) -> None:
        """Stop the loop and every stage process now (well under a second); pending calls
        fail with EngineDeadError("engine closed"). Stages are not asked to finish the steps
        in flight: nothing they would still compute is wanted, so they exit at once. With
        tracing on and no trace written yet, the steps in flight finish first and the trace
        is written (its summary logged)."""
        if getattr(self, "_trace", None) is not None and not self._trace_written and self.is_alive:
            try:
                summary = self.write_trace(timeout=60)
                log.info("%s\ntrace written to %s", summary.text(), self.config.trace)
            except Exception as exc:  # the trace must not keep the engine from closing
                log.warning("could not write the trace: %r", exc)
        with self._wake:
            if self._closed:
                return
            self._closed = True
            self._stop = True
            self._wake.notify()
            self._room.notify_all()
        self._executor.abort()  # a loop waiting on a stage's answer fails over at once
        # The loop leaves at its next check of _stop; one still inside a long step on the
        # driver's own stage is not waited for (it is a daemon, and delivers nothing now).
        self._thread.join(timeout=_CLOSE_JOIN_S)
        self._fail_pending(EngineDeadError("engine closed"))
        self._executor.shutdown()
        if self._lowered_switch:
            self._lowered_switch = False
            switch_interval.restore()

    def _close_and_wait(self) -> None:
        """close(), then wait for a loop thread still in a step to leave it."""
        self.close()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=_EXIT_JOIN_S)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # -- intake -----------------------------------------------------------------------------

    def _new_submission(self, params: PoolingParams, num_inputs: int) -> Submission:
        width = params.dimensions or self.inputs.output_width(params.pooling)
        return Submission(params, num_inputs, width, on_cancel=self._cancel)

    def _enqueue(self, submission: Submission, part: TokenSlice) -> None:
        rows = None  # the call's row of each batch row, where not part.first onwards
        if self.deployment.length_sorted and len(part.lengths) > 1:
            part, order = part.longest_first()
            rows = part.first + order
        with self._wake:  # under the lock, so a request cannot slip in after the engine died
            self._raise_if_dead()
            batch = RequestBatch(
                self._next_id, part.token_ids, part.lengths, submission.params, part.type_ids
            )
            self._next_id += len(batch)
            if rows is None:
                submission.num_tokens[part.first : part.first + len(batch)] = part.lengths
            else:
                submission.num_tokens[rows] = part.lengths
            submission.batches.append(batch)
            self._backlog_tokens += batch.num_tokens
            self._owners.add(submission, part.first, batch, rows)
            self._inbox.append(("add", batch))
            self._wake.notify()
        self.stats.on_submit(len(batch), batch.num_tokens)

    def _cancel(self, submission: Submission) -> None:
        with self._wake:
            self._inbox.append(("abort", submission))
            self._wake.notify()

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
                if inflight and self._short_of_a_step() and self._next_slice_arrived():
                    self._apply_inbox(self._take_inbox())
                t0 = now() if tr is not None else 0
                plan = scheduler.schedule(None if inflight else self._idle_step_tokens())
                if plan is None:
                    break
                submitted = time.perf_counter()
                if tr is not None:
                    tr.submitted(t0)
                    t0 = tr.span("schedule", t0, plan)
                executor.submit(plan)
                self._handed_over(plan)
                if tr is not None:
                    tr.span("submit", t0, plan)
                inflight.append((plan, submitted))
                self.stats.on_plan(plan)
            if inflight:
                t0 = now() if tr is not None else 0
                result = executor.collect()
                plan, submitted = inflight.popleft()
                if tr is not None:
                    t0 = tr.span("wait result", t0, plan)
                ledger = scheduler.update(plan, result, last_stage=executor.num_stages - 1)
                self.stats.on_result(plan, result, time.perf_counter() - submitted)
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

    def _handed_over(self, plan: StepPlan) -> None:
        """A plan is with the stages: its tokens leave the backlog (``_slice_intake``)."""
        with self._wake:
            self._backlog_tokens -= plan.num_tokens
            self._plans_handed_over += 1
            self._room.notify_all()

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
            self._backlog_tokens = sum(batch.num_tokens for batch in batches)
            for batch in batches:
                self._scheduler.add(batch)
                self.stats.on_retry(len(batch))

    def _die(self, cause: BaseException) -> None:
        with self._wake:
            self._dead = cause
            self._restarting = False
            callbacks, self._on_death = self._on_death, []
            self._room.notify_all()
        self.stats.on_error(cause)
        # Callbacks first: a caller whose call fails with the cause may look for them at once.
        for fn in callbacks:
            fn(cause)
        self._fail_pending(cause)
        self._executor.shutdown()

    def _wake_loop(self) -> None:
        with self._wake:
            self._wake.notify()

    def _answer_trace(self) -> None:
        """Every process's spans for the callers of ``write_trace`` (no plan is in flight)."""
        wanted, self._trace_wanted = self._trace_wanted, []
        try:
            traces = [self._trace.export(), *self._executor.gather_trace()]
        except BaseException as exc:
            for future in wanted:
                future.set_exception(exc)
            raise
        for future in wanted:
            future.set_result(traces)

    def _apply_inbox(self, inbox: deque) -> None:
        for kind, payload in inbox:
            if kind == "add":
                self._scheduler.add(payload)
                continue
            if kind == "trace":
                self._trace_wanted.append(payload)
                continue
            for batch in payload.batches:  # a cancelled call: every batch of it
                owner = self._owners.pop(batch.first_id)
                if owner is not None:
                    unplanned = self._scheduler.abort(batch)
                    with self._wake:
                        self._backlog_tokens -= unplanned
                    self.stats.on_abort(owner.remaining)

    def _deliver(self, result: StepResult, ledger: Ledger) -> None:
        """Write the step's finished outputs into their calls' results, one slice per batch."""
        for batch, sel in _by_batch(ledger.batches, result.vector_ids):
            owner = self._finish(batch, result.vector_ids[sel])
            if owner is not None:
                submission, rows = owner
                submission.put_vectors(rows, result.vectors[sel])
        for batch, sel in _by_batch(ledger.batches, result.token_owner_ids):
            owner = self._finish(batch, result.token_owner_ids[sel])
            if owner is not None:
                submission, rows = owner
                offsets = result.token_offsets
                picked = np.arange(len(result.token_owner_ids))[sel].tolist()
                values = [result.token_vectors[offsets[j] : offsets[j + 1]] for j in picked]
                submission.put_tokens(rows, values)

    def _finish(self, batch: RequestBatch, ids: np.ndarray) -> tuple[Submission, np.ndarray] | None:
        """(call, its rows) for finished requests of a batch; None if the call was cancelled."""
        rows = ids - batch.first_id
        self.stats.on_finish(len(rows), int(batch.lengths[rows].sum()))
        return self._owners.finish(batch, ids)

    def _fail_pending(self, exc: BaseException) -> None:
        if not isinstance(exc, PipepoolError):
            exc = EngineDeadError(f"engine stopped: {exc!r}")
        with self._wake:
            owners = self._owners.take_all()
            wanted, self._trace_wanted = self._trace_wanted, []
            wanted += [payload for kind, payload in self._inbox if kind == "trace"]
        for owner in owners:
            owner.submission.fail(exc)
        for future in wanted:
            if not future.done():
                future.set_exception(exc)

    def _raise_if_dead(self) -> None:
        if self._dead is None and self._executor.failure is not None and not self._may_heal():
            self._dead = self._executor.failure  # a stage died while the engine was idle
        if self._dead is not None:
            cause = self._dead
            if isinstance(cause, PipepoolError):
                raise EngineDeadError(f"engine is dead: {cause}") from cause
            raise EngineDeadError(f"engine is dead: {cause!r}") from cause
        if self._closed:
            raise EngineDeadError("engine is closed")


def _engine_class(cls: type, data_parallel_size) -> type:
    """``Engine`` itself, or the replicated engine when several replicas are asked for."""
    if cls is Engine and isinstance(data_parallel_size, int) and data_parallel_size > 1:
        from .replicas.engine import ReplicatedEngine

        return ReplicatedEngine
    return cls


@atexit.register
def _close_at_exit() -> None:
    """Close the engines a program left open. Without this a program that exits with work
    in flight (no close(), no ``with``) dies of SIGABRT ("terminate called without an active
    exception", exit code 134): the interpreter tears down while the loop thread still runs a
    step's torch ops. Runs before the interpreter's own teardown."""
    for engine in list(_open_engines):
        with contextlib.suppress(Exception):
            engine._close_and_wait()


def _by_batch(batches: tuple[RequestBatch, ...], ids: np.ndarray):
    """(batch, where its ids are in ``ids``) for every batch holding some of ``ids``: a slice
    where they lie together (the usual step: outputs come in plan order, and a slice of the
    step's output array is a view, not a copy), else an index array."""
    if not len(ids):
        return
    if len(batches) == 1:
        yield batches[0], slice(0, len(ids))
        return
    firsts = np.array([b.first_id for b in batches])
    which = np.searchsorted(firsts, ids, side="right") - 1
    steps = np.diff(which)
    if (steps >= 0).all():
        edges = [0, *(np.flatnonzero(steps) + 1).tolist(), len(ids)]
        for lo, hi in itertools.pairwise(edges):
            yield batches[int(which[lo])], slice(lo, hi)
        return
    order = np.argsort(which, kind="stable")
    bounds = np.flatnonzero(np.diff(which[order])) + 1
    for group in np.split(order, bounds):
        yield batches[int(which[group[0]])], group


__all__ = ["Engine", "InvalidInputError"]
