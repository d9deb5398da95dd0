"""The engine seen from the event loop: many HTTP requests, one scheduler.

Each HTTP request's inputs become ordinary engine requests, so inputs of different clients
share steps (continuous batching). Tokenization runs on thread pools so the loop keeps
answering, in two lanes: requests with little text to tokenise never wait behind one with a
lot. The engine's futures are awaited with ``asyncio.wrap_future``. A request whose client left
is aborted in the engine, which frees its KV blocks at once.

All methods are called from the event loop thread; the counters are only touched there.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ..api.engine import Engine
from ..core.priority import is_background
from ..core.submission import Submission
from ..errors import EngineDeadError
from ..intake.long_inputs import CombinedSubmission
from . import timing
from .awaiting import Awaiting
from .encoding import Vectors
from .errors import APIError
from .joined_calls import Joinable, JoinedCalls, SharedCall
from .online_gate import BackgroundPool
from .owner import EngineOwner

T = TypeVar("T")
# What Engine.submit returns: a call's future, or its windows' combined (long inputs, chunked).
AnySubmission = Submission | CombinedSubmission


class QueueFullError(Exception):
    """Admitting a request would put more engine requests in flight than allowed."""


class NotReadyError(EngineDeadError):
    """The model is still loading."""


@dataclass
class Encoded:
    """What one HTTP request's inputs became: an output per input, in input order, and each
    input's prompt tokens after truncation (for ``usage``)."""

    # One per input, in input order: the engine's [n, D] matrix for one vector per input
    # (serialised in one go, ``encoding.encode_rows``), else an array per input.
    outputs: Vectors
    num_tokens: list[int]  # prompt tokens per input, after truncation

    def matrix(self) -> np.ndarray:
        """The outputs as one ``[n, ...]`` array: the engine's own where it gave one."""
        if isinstance(self.outputs, np.ndarray):
            return self.outputs
        return np.stack(list(self.outputs))


@dataclass(frozen=True)
class EngineCall:
    """One HTTP request's work for its model's engine, made ready on the event loop (checked,
    within the server's limits): ``inputs``, which the queue counts and whose size picks the
    tokenising lane, and either ``submit`` (enqueues them; the results come by the
    submission's future: ``AsyncEngine.run``) or ``call`` (an engine call that waits for its
    own results: ``AsyncEngine.run_call``). ``renamed``: how the engine's refusals of
    ``input i`` name the request's own field (``routes/images.renamed``), where it is not
    ``input``."""

    inputs: Sequence
    submit: Callable[[Engine], AnySubmission] | None = None
    call: Callable[[Engine], Any] | None = None
    renamed: Callable[[APIError], APIError] | None = None
    # A one-text ``submit`` that may share an engine call with the others of the event
    # loop's turn (``joined_calls``); None: it makes its own.
    join: Joinable | None = None


def _encoded(outputs: Any, num_tokens: list[int], remote_s: float | None) -> Encoded:
    """An engine call's outputs for one request, its time in a replica (if any) timed."""
    if remote_s is not None:
        timing.add("replica", remote_s)
    return Encoded(outputs if isinstance(outputs, np.ndarray) else list(outputs), num_tokens)


# Characters (or token ids) of a request above which it takes the large lane: ~64k characters
# tokenise in a few milliseconds; a request up to the character bound of a long-context model
# may take seconds.
LARGE_REQUEST = 1 << 16
# At most this many characters (or token ids) to tokenise, or numbers and characters to
# serialise, and the event loop does it itself: it holds the interpreter's lock already, where
# a lane's thread would wait for it twice (to start, and to hand the result back) while the
# threads of other requests, and other models, hold it in turns — the wait is the slowest
# small requests' time under a flood (docs/benchmarks/several-models.md, issue 35); the work
# is tens of µs.
INLINE_SIZE = 1024
# A request of at most this many inputs (TEI's default client batch) may use the last
# 1/SMALL_REQUEST_RESERVE of the queue, which larger ones may not while others are queued.
SMALL_REQUEST_INPUTS = 32
SMALL_REQUEST_RESERVE = 8


class AsyncEngine:
    """The server's side of the engine: asyncio calls over the engine's threads, with the
    queue limit (a request that does not fit waits up to ``queue_wait`` seconds for room, in
    the order such requests came, then is refused: 429), tokenising lanes by request size and
    one for background work, and the engine's owner (loading, health)."""

    def __init__(
        self,
        owner: EngineOwner,
        *,
        max_queued: int,
        queue_wait: float = 0.0,
        threads: int | None = None,
    ) -> None:
        self.owner = owner
        self.max_queued = max_queued
        self.queue_wait = queue_wait
        # Requests waiting for room (``_admit``), in arrival order: (inputs, admitted). No cap
        # of their own: each holds its connection, and connections are capped
        # (--max-connections-per-client); one capped here would leave the clients over it
        # refused at once, free to retry at their own pace.
        self._waiters: list[tuple[int, asyncio.Future[bool]]] = []
        # Tokenizers release the GIL; more threads than cores would only queue up.
        workers = threads or max(1, min(4, os.cpu_count() or 1))
        self.tokenizer_threads = workers  # online requests' tokenising threads (TEI's /info)
        self._small = ThreadPoolExecutor(workers, thread_name_prefix="pipepool-tokenize")
        self._large = ThreadPoolExecutor(
            max(1, workers // 2), thread_name_prefix="pipepool-tokenize-large"
        )
        # Background work (batch jobs, ``core.priority``) has a lane of its own: thousands of
        # batch lines queued for tokenising or serialising never hold up an online request,
        # and its threads wait while one is in flight (``online_gate``).
        self._background = BackgroundPool(
            max(1, workers // 2), thread_name_prefix="pipepool-tokenize-background"
        )
        self.joined = JoinedCalls()  # one-text calls of a loop turn, as one engine call
        self.pending = 0  # engine requests admitted here and not yet answered
        self.aborted_http_requests = 0  # HTTP requests cancelled (client left, shutdown)
        self.aborted_inputs = 0  # engine requests aborted on their behalf
        # The routes' requests awaiting their work, given up on when the client leaves, or
        # when the server stops waiting (shutdown timeout): 503 then, not a cancelled request.
        self.awaiting = Awaiting()

    @property
    def waiting(self) -> int:
        """Inputs of the requests waiting for room."""
        return sum(n for n, _ in self._waiters)

    @property
    def engine(self) -> Engine:
        engine = self.owner.engine
        if engine is None:
            if self.owner.error is not None:
                # Its cause (a file that would not load, say) is in the server's log; the
                # message may name the server's files, so clients are not told it.
                raise EngineDeadError("the engine failed to start (the server's log says why)")
            raise NotReadyError("the model is still loading; retry shortly")
        return engine

    async def run(
        self,
        n: int,
        submit: Callable[[Engine], AnySubmission],
        texts: Sequence = (),
        join: Joinable | None = None,
    ) -> Encoded:
        """``submit(engine)`` (tokenizes and enqueues ``n`` engine requests) on a tokenising
        lane chosen by the size of ``texts`` (what it will tokenise; on the event loop itself
        up to ``INLINE_SIZE``: there, with ``join``, in one call with the other one-text
        requests of the loop's turn, ``joined_calls``), then wait for its
        results. Raises QueueFullError (past ``max_queued``), and what ``submit`` or the engine
        raise (InvalidInputError, EngineDeadError, ...); cancelling the caller aborts whatever
        was enqueued."""
        engine = self.engine
        await self._admit(n)
        try:
            queued = time.perf_counter()
            lane = self._lane(texts)
            if lane is None and join is not None and n == 1:
                return await self._run_joined(engine, join, texts[0], submit, queued)
            if lane is None:  # little to tokenise: here, on the loop (a single slice never waits)
                submission = submit(engine)
            else:

                def submit_on_lane(engine: Engine) -> AnySubmission:
                    timing.add("lane", time.perf_counter() - queued)
                    return submit(engine)

                # In this task's context, so that what marks the call (``core.priority``'s
                # background work) reaches Engine.submit on the tokenising thread.
                context = contextvars.copy_context()
                loop = asyncio.get_running_loop()
                submitting = loop.run_in_executor(lane, context.run, submit_on_lane, engine)
                try:
                    submission = await asyncio.shield(submitting)
                except asyncio.CancelledError:
                    # Cancelled mid-tokenization: the requests may still be enqueued; abort
                    # them as soon as they are.
                    submitting.add_done_callback(self._abort_when_submitted)
                    raise
            timing.add("tokenize", time.perf_counter() - queued)
            try:
                with timing.phase("engine"):
                    outputs = await asyncio.wrap_future(submission)
            except BaseException:
                self._abort(submission)
                raise
            return _encoded(outputs, submission.num_tokens.tolist(), submission.remote_s)
        finally:
            self._free(n)

    async def _run_joined(
        self,
        engine: Engine,
        join: Joinable,
        text: Any,
        alone: Callable[[Engine], AnySubmission],
        queued: float,
    ) -> Encoded:
        """``run``'s one text, its engine call joined with the loop turn's others."""
        joining = self.joined.add(engine, join, text, alone)
        try:
            call, row = await joining
        except asyncio.CancelledError:
            if joining.done() and not joining.cancelled() and joining.exception() is None:
                self._leave(*joining.result())  # joined just before the client left
            raise
        timing.add("tokenize", time.perf_counter() - queued)
        try:
            with timing.phase("engine"):
                outputs, tokens = await call.wait(row)
        except BaseException:
            self._leave(call, row)
            raise
        return _encoded(outputs, [tokens], call.submission.remote_s)

    def _leave(self, call: SharedCall, row: int) -> None:
        if call.leave(row):
            self.aborted_http_requests += 1
            self.aborted_inputs += 1

    async def perform(self, work: EngineCall) -> Any:
        """``work`` by ``run`` (an ``Encoded``) or ``run_call`` (what its call returns)."""
        n = len(work.inputs)
        if work.submit is not None:
            return await self.run(n, work.submit, work.inputs, work.join)
        assert work.call is not None, "an EngineCall has a submit or a call"
        return await self.run_call(n, work.call, work.inputs)

    async def run_call(self, n: int, call: Callable[[Engine], T], texts: Sequence = ()) -> T:
        """``call(engine)``, an engine call that waits for its own results (the retrieval
        outputs, ``Engine.encode_outputs``; MaxSim scores), on a tokenising lane chosen as
        ``run`` chooses it, its ``n`` inputs counted in progress (429 past ``max_queued``)
        until it returns. Cancelling the caller does not stop the call: it runs to its end
        and its result is dropped."""
        engine = self.engine
        await self._admit(n)
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()  # as in ``run``: the call's priority goes along
        lane = self._lane(texts) or self._small  # the call waits for its results: never here
        running = loop.run_in_executor(lane, context.run, call, engine)
        running.add_done_callback(lambda done: self._release(n, done))
        with timing.phase("engine"):  # its tokenising too: one call on the lane's thread
            return await asyncio.shield(running)

    async def offload(self, fn: Callable[[], T], *, size: int = 0) -> T:
        """Run CPU work (e.g. serializing a large response, ``size`` values) off the event
        loop; up to ``INLINE_SIZE`` values, on it."""
        pool: ThreadPoolExecutor = self._background
        if not is_background():
            if size <= INLINE_SIZE:
                return fn()
            pool = self._large if size > LARGE_REQUEST else self._small
        with timing.phase("offload"):
            return await asyncio.get_running_loop().run_in_executor(pool, fn)

    def abandon_after(self, seconds: float) -> None:
        """Shutdown began: requests still in flight in ``seconds`` get 503 (``awaiting``)."""
        asyncio.get_running_loop().call_later(seconds, self.awaiting.abandon)

    def close(self) -> None:
        for pool in (self._small, self._large, self._background):
            pool.shutdown(wait=True, cancel_futures=True)

    async def _admit(self, n: int) -> None:
        """Count ``n`` inputs in progress: at once where they fit, else after waiting up to
        ``queue_wait`` for room. A client that retries the moment it is refused, whatever
        Retry-After says, is so held to a request per ``queue_wait`` on each connection, and
        the server reads and parses its request that often, not at the client's pace: at 50
        retries a second from 96 clients the refusals alone left the other models' slowest
        requests 5-9x slower (docs/benchmarks/several-models.md, issue 35)."""
        if self._limit(n) >= self.pending + n:
            self.pending += n
            return
        if self.queue_wait <= 0:
            raise self._full(n)
        # True once admitted (``_free``), False when the wait ran out (``_expire``).
        loop = asyncio.get_running_loop()
        admitted: asyncio.Future[bool] = loop.create_future()
        waiter = (n, admitted)
        self._waiters.append(waiter)
        timer = loop.call_later(self.queue_wait, self._expire, waiter)
        try:
            if not await admitted:
                raise self._full(n)
        except asyncio.CancelledError:  # the client left: give back what ``_free`` counted
            if admitted.done() and not admitted.cancelled() and admitted.result():
                self._free(n)
            raise
        finally:
            timer.cancel()
            self._forget(waiter)

    def _expire(self, waiter: tuple[int, asyncio.Future[bool]]) -> None:
        """A waiter's time ran out before room freed."""
        if self._forget(waiter) and not waiter[1].done():  # (done: cancelled, client gone)
            waiter[1].set_result(False)

    def _forget(self, waiter: tuple[int, asyncio.Future[bool]]) -> bool:
        """Take ``waiter`` off the list; whether it was on it."""
        if waiter not in self._waiters:
            return False
        self._waiters.remove(waiter)
        return True

    def _limit(self, n: int) -> int:
        """The most inputs in progress with which a request of ``n`` is admitted."""
        if n > SMALL_REQUEST_INPUTS and self.pending:
            # The last part of the queue is kept for small requests: clients that fill the
            # queue with large ones cannot turn every one-text request away.
            return self.max_queued - self.max_queued // SMALL_REQUEST_RESERVE
        return self.max_queued

    def _full(self, n: int) -> QueueFullError:
        limit = self._limit(n)
        waited = f" (waited {self.queue_wait:g} s for room)" if self.queue_wait > 0 else ""
        return QueueFullError(
            f"the server has {self.pending} inputs in progress; this request's {n} would "
            f"exceed --max-queued-requests={self.max_queued}"
            + ("" if limit == self.max_queued else " less the part kept for small requests")
            + f"{waited}. Retry later."
        )

    def _free(self, n: int) -> None:
        """``n`` inputs are no longer in progress: admit the waiting requests that now fit,
        in the order they came (one that does not fit lets a later, smaller one by)."""
        self.pending -= n
        for waiter in list(self._waiters):
            size, admitted = waiter
            if admitted.done() or self._limit(size) < self.pending + size:
                continue
            self._forget(waiter)
            self.pending += size
            admitted.set_result(True)

    def _release(self, n: int, done: asyncio.Future) -> None:
        """A ``run_call`` ended (on the loop thread): its inputs are no longer in progress."""
        self._free(n)
        if not done.cancelled():
            done.exception()  # read: a caller that left never will (no "never retrieved")

    def _lane(self, inputs: Sequence) -> ThreadPoolExecutor | None:
        """The pool for a request: background work's, or by how much there is to tokenise (or
        to check); None: so little that the event loop does it (``INLINE_SIZE``)."""
        if is_background():
            return self._background
        size = 0
        for x in inputs:
            size += len(x) if isinstance(x, (str, Sequence)) else 1
            if size > LARGE_REQUEST:
                return self._large
        return self._small if size > INLINE_SIZE else None

    def _abort(self, submission: AnySubmission) -> None:
        unanswered = submission.num_inputs - submission.num_done
        submission.cancel()  # (wrap_future may have cancelled it already)
        if submission.cancelled() and unanswered:
            self.aborted_http_requests += 1
            self.aborted_inputs += unanswered

    def _abort_when_submitted(self, submitting: asyncio.Future) -> None:
        if not submitting.cancelled() and submitting.exception() is None:
            self._abort(submitting.result())
