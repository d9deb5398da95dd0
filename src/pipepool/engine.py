"""The Engine: the one object every front end (Python API, CLI, HTTP server) sits on.

Requests from any thread go into an inbox; one loop thread owns the scheduler and the
executor, keeps up to ``executor.depth`` plans in flight, and resolves each request's future
when its result arrives. A stage failure fails every pending and later request with the cause.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np

from .config import EngineConfig
from .deployment import Deployment, plan_deployment
from .errors import EngineDeadError, InvalidInputError, PipepoolError
from .heads import apply_heads
from .inputs import InputPreparer
from .kv_blocks import BlockAllocator
from .parallel.executor import Executor
from .parallel.launch import start_executor
from .plan import StepPlan
from .request import PoolingParams, Request
from .scheduler import Scheduler
from .signal_mask import block_stop_signals
from .stats import EngineStats


class Engine:
    """Embeds text or token ids with a pooling model, optionally split into pipeline stages.

    ``embed`` and ``embed_tokens`` are thread-safe and may be called concurrently; results come
    back in input order. Use as a context manager, or call ``close()``.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        device: str = "auto",
        max_num_batched_tokens: int = 16384,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        pipeline_parallel_size: int = 1,
        pooling: str | None = None,
        normalize: bool | None = None,
        **options,
    ) -> None:
        config = EngineConfig(
            model=model,
            dtype=dtype,
            device=device,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            pipeline_parallel_size=pipeline_parallel_size,
            pooling=pooling,
            normalize=normalize,
            **options,
        )
        self._init(config)

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        engine = cls.__new__(cls)
        engine._init(config)
        return engine

    def _init(self, config: EngineConfig) -> None:
        self._closed = True  # until fully started, close() has nothing to stop
        self.config = config
        self.deployment: Deployment = plan_deployment(config)
        d = self.deployment
        self.inputs = InputPreparer(d)
        self.stats = EngineStats(d.num_stages)
        blocks = BlockAllocator(d.num_kv_blocks, config.block_size) if d.causal else None
        self._scheduler = Scheduler(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            chunked=d.causal,
            blocks=blocks,
        )
        self._executor: Executor = start_executor(d)  # last: it starts processes
        self._ids = itertools.count()
        self._futures: dict[int, tuple[Future, PoolingParams]] = {}
        self._inbox: deque = deque()
        self._wake = threading.Condition()
        self._dead: BaseException | None = None
        self._closed = False
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="pipepool-engine", daemon=True)
        self._thread.start()

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
    ) -> np.ndarray:
        """One vector per input, ``[n, dim]`` float32, in input order."""
        out = self.encode(
            inputs,
            pooling=self.deployment.pooling,
            dimensions=dimensions,
            normalize=normalize,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
            prompt_name=prompt_name,
        )
        return np.stack(out)

    def embed_tokens(
        self,
        inputs: str | Sequence[str] | Sequence[Sequence[int]],
        *,
        normalize: bool = False,
        truncate_prompt_tokens: int | None = None,
        truncation_side: str = "right",
        prompt_name: str | None = None,
    ) -> list[np.ndarray]:
        """Token embeddings (ALL pooling): one ``[len, hidden]`` float32 array per input."""
        return self.encode(
            inputs,
            pooling="all",
            normalize=normalize,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
            prompt_name=prompt_name,
        )

    def encode(self, inputs, *, pooling: str, **kwargs) -> list[np.ndarray]:
        """Any pooling (last | mean | cls | all) for a batch of inputs; blocks until done."""
        futures = self.submit(inputs, pooling=pooling, **kwargs)
        return [f.result() for f in futures]

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
    ) -> list[Future]:
        """Validate, tokenize and enqueue; one future per input (for async front ends).

        Raises InvalidInputError before anything is enqueued if any input is bad.
        """
        prompts = self.inputs.prepare(
            inputs,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
            prompt_name=prompt_name,
        )
        params = self.inputs.params(pooling or self.deployment.pooling, dimensions, normalize)
        return self.submit_tokens(prompts, params)

    def submit_tokens(self, prompts: list[np.ndarray], params: PoolingParams) -> list[Future]:
        """Enqueue already validated token ids (see ``InputPreparer``)."""
        futures = []
        with self._wake:  # under the lock, so a request cannot slip in after the engine died
            self._raise_if_dead()
            requests = []
            for ids in prompts:
                request = Request(next(self._ids), ids, params)
                future: Future = Future()
                future.request_id = request.request_id
                self._futures[request.request_id] = (future, params)
                requests.append(request)
                futures.append(future)
            self._inbox.append(("add", requests))
            self._wake.notify()
        self.stats.on_submit(len(prompts), sum(len(p) for p in prompts))
        return futures

    def abort(self, request_ids: Sequence[int]) -> None:
        """Cancel requests (e.g. their client went away); their KV blocks are freed."""
        with self._wake:
            self._inbox.append(("abort", list(request_ids)))
            self._wake.notify()

    def tokenize(self, inputs, **kwargs) -> list[np.ndarray]:
        return self.inputs.prepare(inputs, **kwargs)

    def stage_busy_s(self) -> list[float]:
        """Seconds each stage has spent computing so far (for idle fractions). Stages report
        with their step results, device time only once the device got there, so a one-token
        step brings every figure up to date first."""
        self.submit_tokens([np.zeros(1, dtype=np.int64)], self.inputs.params("last", None, False))[
            0
        ].result()
        return list(self.stats.stage_busy_s)

    @property
    def kv_blocks_free(self) -> int | None:
        """Free KV-cache blocks now (None for encoders, which keep no KV cache).

        Safe from any thread: the loop thread owns the allocator, this only reads a length.
        """
        blocks = self._scheduler.blocks
        return None if blocks is None else blocks.num_free

    @property
    def is_alive(self) -> bool:
        """False once closed, or once a stage failed (even with no request in flight)."""
        return self._dead is None and not self._closed and self._executor.failure is None

    def close(self) -> None:
        """Stop the loop and every stage process; pending requests fail with EngineDeadError."""
        with self._wake:
            if self._closed:
                return
            self._closed = True
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=30)
        self._fail_pending(EngineDeadError("engine closed"))
        self._executor.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # -- the loop ---------------------------------------------------------------------------

    def _loop(self) -> None:
        block_stop_signals()  # Ctrl-C is the main thread's (and so are the threads we start)
        inflight: deque[StepPlan] = deque()
        try:
            while True:
                with self._wake:
                    while not (
                        self._inbox or self._stop or inflight or self._scheduler.has_schedulable()
                    ):
                        self._wake.wait()
                    if self._stop:
                        return
                    inbox, self._inbox = self._inbox, deque()
                self._apply_inbox(inbox)
                while len(inflight) < self._executor.depth:
                    plan = self._scheduler.schedule()
                    if plan is None:
                        break
                    self._executor.submit(plan)
                    inflight.append(plan)
                    self.stats.on_plan(plan)
                if inflight:
                    t0 = time.perf_counter()
                    result = self._executor.collect()
                    plan = inflight.popleft()
                    finished = self._scheduler.update(
                        plan, result, last_stage=self._executor.num_stages - 1
                    )
                    self.stats.on_result(plan, result, time.perf_counter() - t0)
                    self._deliver(finished)
                self.stats.set_queue(len(self._scheduler.waiting), len(self._scheduler.requests))
        except BaseException as exc:  # a stage failed or diverged: nothing more can be trusted
            with self._wake:
                self._dead = exc
            self.stats.on_error(exc)
            self._fail_pending(exc)
            self._executor.shutdown()

    def _apply_inbox(self, inbox: deque) -> None:
        for kind, payload in inbox:
            if kind == "add":
                for request in payload:
                    self._scheduler.add(request)
            else:
                for rid in payload:
                    if self._scheduler.abort(rid) is not None:
                        self.stats.on_abort()
                    entry = self._futures.pop(rid, None)
                    if entry is not None:
                        entry[0].cancel()

    def _deliver(self, finished: list[Request]) -> None:
        for request in finished:
            entry = self._futures.pop(request.request_id, None)
            if entry is None:
                continue
            future, params = entry
            if not future.cancelled():
                future.set_result(apply_heads(request.output, params))
            self.stats.on_finish(request.prompt_len)

    def _fail_pending(self, exc: BaseException) -> None:
        if not isinstance(exc, PipepoolError):
            exc = EngineDeadError(f"engine stopped: {exc!r}")
        with self._wake:
            futures, self._futures = self._futures, {}
        for future, _ in futures.values():
            if not future.done():
                future.set_exception(exc)

    def _raise_if_dead(self) -> None:
        if self._dead is None and self._executor.failure is not None:
            self._dead = self._executor.failure  # a stage died while the engine was idle
        if self._dead is not None:
            cause = self._dead
            if isinstance(cause, PipepoolError):
                raise EngineDeadError(f"engine is dead: {cause}") from cause
            raise EngineDeadError(f"engine is dead: {cause!r}") from cause
        if self._closed:
            raise EngineDeadError("engine is closed")


__all__ = ["Engine", "InvalidInputError"]
