"""The engine seen from the event loop: many HTTP requests, one scheduler.

Each HTTP request's inputs become ordinary engine requests, so inputs of different clients
share steps (continuous batching). Tokenization runs on a small thread pool so the loop keeps
answering; the engine's futures are awaited with ``asyncio.wrap_future``. A request whose
client left is aborted in the engine, which frees its KV blocks at once.

All methods are called from the event loop thread; the counters are only touched there.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from ..engine import Engine
from ..errors import EngineDeadError
from ..submission import Submission
from .owner import EngineOwner

T = TypeVar("T")


class QueueFullError(Exception):
    """Admitting a request would put more engine requests in flight than allowed."""


class NotReadyError(EngineDeadError):
    """The model is still loading."""


@dataclass
class Encoded:
    outputs: list[np.ndarray]  # one per input, in input order
    num_tokens: list[int]  # prompt tokens per input, after truncation


class AsyncEngine:
    def __init__(self, owner: EngineOwner, *, max_queued: int, threads: int | None = None) -> None:
        self.owner = owner
        self.max_queued = max_queued
        # Tokenizers release the GIL; more threads than cores would only queue up.
        workers = threads or max(1, min(4, os.cpu_count() or 1))
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="pipepool-tokenize")
        self.pending = 0  # engine requests admitted here and not yet answered
        self.aborted_http_requests = 0  # HTTP requests cancelled (client left, shutdown)
        self.aborted_inputs = 0  # engine requests aborted on their behalf

    @property
    def engine(self) -> Engine:
        engine = self.owner.engine
        if engine is None:
            if self.owner.error is not None:
                raise EngineDeadError(f"the engine failed to start: {self.owner.error}")
            raise NotReadyError("the model is still loading; retry shortly")
        return engine

    async def encode(
        self,
        inputs: Sequence,
        *,
        pooling: str | None = None,
        dimensions: int | None = None,
        normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        long_inputs: str | None = None,
        truncation_side: str = "right",
        prompt_name: str | None = None,
    ) -> Encoded:
        """Tokenize, enqueue and wait; raises QueueFullError, InvalidInputError,
        EngineDeadError. Cancelling the caller aborts whatever was enqueued."""
        return await self.run(
            len(inputs),
            lambda engine: engine.submit(
                inputs,
                pooling=pooling,
                dimensions=dimensions,
                normalize=normalize,
                truncate_prompt_tokens=truncate_prompt_tokens,
                long_inputs=long_inputs,
                truncation_side=truncation_side,
                prompt_name=prompt_name,
            ),
        )

    async def run(self, n: int, submit: Callable[[Engine], Submission]) -> Encoded:
        """``submit(engine)`` (tokenizes and enqueues ``n`` engine requests) on the thread
        pool, then wait for its results; the queue limit, errors and aborts as for encode."""
        engine = self.engine
        if self.pending + n > self.max_queued:
            raise QueueFullError(
                f"the server has {self.pending} inputs in progress; this request's {n} would "
                f"exceed --max-queued-requests={self.max_queued}. Retry later."
            )
        self.pending += n
        try:
            loop = asyncio.get_running_loop()
            submitting = loop.run_in_executor(self._pool, lambda: submit(engine))
            try:
                submission = await asyncio.shield(submitting)
            except asyncio.CancelledError:
                # Cancelled mid-tokenization: the requests may still be enqueued; abort
                # them as soon as they are.
                submitting.add_done_callback(self._abort_when_submitted)
                raise
            try:
                outputs = await asyncio.wrap_future(submission)
            except BaseException:
                self._abort(submission)
                raise
            return Encoded(list(outputs), submission.num_tokens.tolist())
        finally:
            self.pending -= n

    async def tokenize(self, text: str) -> np.ndarray:
        engine = self.engine
        loop = asyncio.get_running_loop()
        (ids,) = await loop.run_in_executor(self._pool, lambda: engine.tokenize([text]))
        return ids

    async def offload(self, fn: Callable[[], T]) -> T:
        """Run CPU work (e.g. serializing a large response) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _abort(self, submission: Submission) -> None:
        unanswered = submission.num_inputs - submission.num_done
        submission.cancel()  # (wrap_future may have cancelled it already)
        if submission.cancelled() and unanswered:
            self.aborted_http_requests += 1
            self.aborted_inputs += unanswered

    def _abort_when_submitted(self, submitting: asyncio.Future) -> None:
        if not submitting.cancelled() and submitting.exception() is None:
            self._abort(submitting.result())
