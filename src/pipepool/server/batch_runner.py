"""Running batch lines: the dispatcher that answers each line as the server's own route would,
the window that keeps many lines in flight, and the server's runner of stored batches.

Each line's body is POSTed to the app in-process through ASGI (``Dispatcher``): the same
validation, limits, error bodies and status codes as an HTTP client gets, inside
``background_work()`` so that the engine runs it only where online requests leave room.
``run_lines`` keeps a window of lines in flight (thousands of inputs: full steps) and hands
finished lines to a writer in groups. ``BatchRunner`` runs the unfinished batches of a state
directory one after another (``batch_store.py`` makes it exactly once across kills), in the
server's main process on a thread and event loop of its own (``batch_thread.py``), which yields
the process's host time to online requests (``online_gate.py``); ``pipepool
run-batch`` runs a file through the same dispatcher and window.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx

from ..core.priority import background_work
from ..jobs.batch_lines import (
    BatchRequest,
    LineChecker,
    LineError,
    LineResult,
    answer_line,
    check_file,
    count_inputs,
    numbered_lines,
    prompt_tokens,
    read_lines,
)
from .batch_output import BatchOutput
from .batch_store import UNFINISHED, BatchRecord, BatchStore, StoreUnavailable

__all__ = [
    "WINDOW_INPUTS",
    "BatchRunner",
    "Dispatcher",
    "EngineFailedError",
    "run_lines",
]

log = logging.getLogger("pipepool.server")

# The window of lines in flight: inputs enough to fill the engine's steps, lines few enough
# that a cancel or a stop waits for little, and the batch's host work stays bounded.
WINDOW_INPUTS = 4096
WINDOW_LINES = 1024
# Answers that say "not now" (queue full, model loading): the line is sent again after a
# pause that doubles up to the last, not written.
_RETRY_STATUSES = (429, 503)
_RETRY_PAUSES_S = (0.05, 0.1, 0.2, 0.5, 1.0)
_CLIENT = "batch"  # the client address the app sees for a batch line
# Pauses between two tries of a store that had a fault (disk full, I/O error): doubling to
# the last, which a store that stays broken is tried at.
_STORE_PAUSES_S = (0.25, 0.5, 1.0, 2.0)


class EngineFailedError(Exception):
    """The engine failed for good: lines cannot be answered, the run stops (to resume)."""


class Dispatcher:
    """Answers batch lines through an app's own routes, in-process. ``engine_failed()`` says
    when retrying a 503 is pointless. A server with an API key is sent it: the call is the
    server's own."""

    def __init__(self, app: Any, *, api_key: str | None, engine_failed: Callable[[], bool]) -> None:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False, client=(_CLIENT, 0))
        self._client = httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None)
        self._headers = {"content-type": "application/json"}
        if api_key is not None:
            self._headers["authorization"] = f"Bearer {api_key}"
        self._engine_failed = engine_failed
        _quiet_lines()

    async def answer(self, request: BatchRequest) -> LineResult:
        """Send the line until it is answered with anything but "not now"; its output line."""
        # ASCII: a lone surrogate stays an escape, which the guards refuse as they would online.
        content = json.dumps(request.body, ensure_ascii=True, separators=(",", ":")).encode()
        pauses = iter(_RETRY_PAUSES_S)
        with background_work():
            while True:
                response = await self._client.post(request.url, content=content,
                                                   headers=self._headers)  # fmt: skip
                if response.status_code not in _RETRY_STATUSES:
                    break
                if self._engine_failed():
                    raise EngineFailedError("the engine failed; batches resume at the next start")
                await asyncio.sleep(next(pauses, _RETRY_PAUSES_S[-1]))
        is_json = "json" in response.headers.get("content-type", "")
        text = answer_line(request.custom_id, response.status_code, response.content, is_json)
        tokens = prompt_tokens(response.content) if response.is_success and is_json else 0
        return LineResult(request.line, response.is_success, text, tokens)

    async def aclose(self) -> None:
        await self._client.aclose()


async def run_lines(
    items: AsyncIterator[BatchRequest | LineError],
    dispatcher: Dispatcher,
    write: Callable[[list[LineResult]], None],
    *,
    stop: Callable[[], bool] = lambda: False,
    window_inputs: int = WINDOW_INPUTS,
    window_lines: int = WINDOW_LINES,
) -> bool:
    """Answer ``items`` with up to ``window_inputs`` inputs (and ``window_lines`` lines) in
    flight, handing finished lines to ``write`` in groups, in the order they finish. Once
    ``stop()`` says so no line is sent; those in flight finish and are written. True if every
    item was answered. Cancelled, or on an error, it cancels the lines in flight (unwritten)."""
    in_flight: dict[asyncio.Task[LineResult], int] = {}  # task -> its inputs
    weight = 0
    exhausted = False
    finished: list[LineResult] = []
    try:
        while True:
            while not exhausted and weight < window_inputs and len(in_flight) < window_lines:
                if stop():
                    break
                item = await anext(items, None)
                if item is None:
                    exhausted = True
                elif isinstance(item, LineError):
                    finished.append(LineResult(item.line, False, item.output()))
                else:
                    n = count_inputs(item.body)
                    in_flight[asyncio.create_task(dispatcher.answer(item))] = n
                    weight += n
            if finished:
                write(finished)
                finished = []
            if not in_flight:
                return exhausted
            done, _ = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                weight -= in_flight.pop(task)
                finished.append(task.result())
    finally:
        for task in in_flight:
            task.cancel()
        await asyncio.gather(*in_flight, return_exceptions=True)


class BatchRunner:
    """Runs the unfinished batches of a store, oldest first, one at a time, in the event loop
    that runs ``run()``: validating (the whole file, as OpenAI does), in_progress (lines through the
    dispatcher), finalizing; a batch being cancelled, or past its ``expires_at``, stops
    sending lines, lets those in flight finish and ends with what it has. Resumes what a
    killed process left (``batch_store.py``: exactly once). One runner per state directory:
    a second one (another server on the same directory) waits for the first's lock.

    A line longer than ``max_line_bytes`` (None: no bound) is answered ``line_too_large``
    unread: the server would refuse its body anyway, and it is never held in memory whole.

    ``ready()``: the engine is loaded; ``stopping()``: the server is shutting down: no line
    is sent any more and the batch stays in progress (what was in flight when the event loop
    ended runs again at the next start)."""

    def __init__(
        self,
        state_dir: Path,
        dispatcher: Dispatcher,
        *,
        max_requests: int,
        max_line_bytes: int | None = None,
        ready: Callable[[], bool],
        stopping: Callable[[], bool],
        window_inputs: int = WINDOW_INPUTS,
        poll_s: float = 0.25,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.state_dir = state_dir
        self.dispatcher = dispatcher
        self.max_requests = max_requests
        self.max_line_bytes = max_line_bytes
        self.ready = ready
        self.stopping = stopping
        self.window_inputs = window_inputs
        self.poll_s = poll_s
        self.clock = clock
        self._store: BatchStore | None = None
        self._active: str | None = None  # the batch run_batch works on

    @property
    def store(self) -> BatchStore:
        assert self._store is not None, "opened by run()"
        return self._store

    async def run(self) -> None:
        """Once the state directory holds a store (a route made it: a server that is never
        sent a batch touches nothing), take its lock, then run batches as they come, until
        cancelled or the server stops. A storage fault never ends it: the batch it stopped
        waits, and goes on once the store can be written again (``_wait_for_store``)."""
        while not BatchStore.exists(self.state_dir):
            if self.stopping():
                return
            await asyncio.sleep(self.poll_s)
        lock = await self._lock()
        try:
            self._store = await self._open_store()
            if self._store is None:
                return  # stopping
            sweeper = asyncio.create_task(self._sweep())
            try:
                while not self.stopping():
                    try:
                        await self._run_pending()
                    except StoreUnavailable as fault:
                        log.warning("batches wait for the store: %s", fault.reason)
                        await self._wait_for_store()
            finally:
                sweeper.cancel()
                self.store.close()
        finally:
            os.close(lock)

    async def _run_pending(self) -> None:
        pending = self.store.unfinished() if self.ready() else []
        for record in pending:
            if self.stopping():
                break
            await self._run_or_fail(record.id)
        if not pending:
            await asyncio.sleep(self.poll_s)

    async def _open_store(self) -> BatchStore | None:
        """The store, opened as soon as it can be (None: the server stops first)."""
        pauses = iter(_STORE_PAUSES_S)
        while not self.stopping():
            try:
                return BatchStore(self.state_dir)
            except StoreUnavailable as fault:
                log.warning("batches wait for the store: %s", fault.reason)
                await asyncio.sleep(next(pauses, _STORE_PAUSES_S[-1]))
        return None

    async def _wait_for_store(self) -> None:
        """Until a probe write succeeds (or the server stops)."""
        pauses = iter(_STORE_PAUSES_S)
        while not self.stopping():
            await asyncio.sleep(next(pauses, _STORE_PAUSES_S[-1]))
            try:
                self.store.probe()
            except StoreUnavailable:
                continue
            return

    async def run_batch(self, batch_id: str) -> None:
        """Take one batch as far as it goes now: to its end, or until the server stops."""
        self._active = batch_id
        record = self.store.batch(batch_id)
        assert record is not None, batch_id
        if record.status == "validating":
            if self.clock() >= record.expires_at:
                self.store.finish(batch_id, "expired")
                return
            await self._validate(record)
        status = self.store.status(batch_id)
        if status in ("in_progress", "cancelling", "finalizing"):
            self.store.cut_to_committed(batch_id)
        if status == "in_progress" and not await self._run_requests(batch_id):
            return  # the server is stopping (or the batch expired): nothing more to do now
        status = self.store.status(batch_id)
        if status == "cancelling":
            self.store.finish(batch_id, "cancelled")
        elif status in ("in_progress", "finalizing"):
            if self.store.move(batch_id, ("in_progress",), "finalizing") or status == "finalizing":
                self.store.finish(batch_id, "completed")
            else:  # cancelled as its last line finished
                self.store.finish(batch_id, "cancelled")
        final = self.store.batch(batch_id)
        assert final is not None, batch_id
        log.info("batch %s %s: %d answered, %d failed of %d", batch_id, final.status,
                 final.completed, final.failed, final.total)  # fmt: skip

    async def _run_or_fail(self, batch_id: str) -> None:
        """``run_batch``; a batch that raises fails (the others go on), but for an engine that
        failed, which stops the runner: its batches resume at the next start."""
        try:
            await self.run_batch(batch_id)
        except (EngineFailedError, StoreUnavailable):
            raise  # not the batch's fault: it resumes
        except Exception:
            log.exception("batch %s failed", batch_id)
            # The exception may name the server's files: the client is told only where to look.
            why = _file_error(
                "batch_failed", "the batch could not be run (the server's log says why)"
            )
            self.store.move(batch_id, UNFINISHED, "failed", errors=json.dumps([why]))

    async def _sweep(self) -> None:
        """End the batches cancelled while another one runs: they wait for nothing."""
        while True:
            try:
                for record in self.store.unfinished():
                    if record.status == "cancelling" and record.id != self._active:
                        self.store.cut_to_committed(record.id)
                        self.store.finish(record.id, "cancelled")
            except StoreUnavailable:
                pass  # tried again next time: the fault is on the store's health already
            await asyncio.sleep(self.poll_s)

    async def _validate(self, record: BatchRecord) -> None:
        path = self.store.path(record.input_file_id)
        if not path.is_file() or self.store.file(record.input_file_id) is None:
            message = f"the input file {record.input_file_id} was deleted"
            self.store.fail(record.id, [_file_error("file_not_found", message)])
            return

        def check():
            with open(path, "rb") as file:
                lines = numbered_lines(file, self.max_line_bytes)
                return check_file(lines, record.endpoint, self.max_requests)

        # Off the loop: a file of 200 MB takes a while to parse, and online requests go on.
        checked = await asyncio.to_thread(check)
        if checked.errors:
            self.store.fail(record.id, checked.errors)
            return
        self.store.set_total(record.id, checked.total)
        if self.store.move(record.id, ("validating",), "in_progress"):
            log.info("batch %s in progress: %d requests to %s", record.id, checked.total,
                     record.endpoint)  # fmt: skip

    async def _run_requests(self, batch_id: str) -> bool:
        """Answer the lines not answered yet; False if the server stopped it first."""
        record = self.store.batch(batch_id)
        assert record is not None, batch_id
        done = self.store.done_lines(batch_id)
        if done:
            log.info("batch %s resumes: %d of %d lines were answered before", batch_id,
                     len(done), record.total)  # fmt: skip
        path = self.store.path(record.input_file_id)
        stop = _StopCheck(self.store, record, self.stopping, self.clock)
        with BatchOutput(self.store, record) as bodies:
            items = read_lines(path, LineChecker(record.endpoint), lambda i: i.line in done,
                               max_line_bytes=self.max_line_bytes)  # fmt: skip
            all_sent = await run_lines(items, self.dispatcher, bodies.write, stop=stop,
                                       window_inputs=self.window_inputs)  # fmt: skip
            if all_sent or self.store.status(batch_id) == "cancelling":
                return True
            if self.clock() < record.expires_at:
                return False  # stopping
            # Expired: what was not answered is in the error file, as OpenAI writes it.
            done = self.store.done_lines(batch_id)
            expired = []
            async for item in read_lines(path, LineChecker(record.endpoint),
                                         lambda i: i.line in done,
                                         max_line_bytes=self.max_line_bytes):  # fmt: skip
                expired.append(LineResult(item.line, False, _expired(item).output()))
            bodies.write(expired)
        self.store.finish(batch_id, "expired")
        return False

    async def _lock(self) -> int:
        """The state directory's runner lock (POSIX: released when this process dies, and not
        held by the processes it forks), waited for while another process holds it."""
        fd = os.open(self.state_dir / "runner.lock", os.O_RDWR | os.O_CREAT, 0o600)
        told = False
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except OSError:
                if not told:
                    log.warning("another process runs the batches of %s; this one waits",
                                self.state_dir)  # fmt: skip
                    told = True
                await asyncio.sleep(max(self.poll_s, 1.0))


class _StopCheck:
    """Whether a batch in progress should stop sending lines: the server stops, the batch is
    being cancelled (asked in the store, at most every ``interval_s``), or it expired."""

    def __init__(
        self,
        store: BatchStore,
        record: BatchRecord,
        stopping: Callable[[], bool],
        clock: Callable[[], float],
        interval_s: float = 0.2,
    ) -> None:
        self.store, self.record, self.stopping, self.clock = store, record, stopping, clock
        self.interval_s = interval_s
        self._asked = 0.0
        self._cancelling = False

    def __call__(self) -> bool:
        now = time.monotonic()
        if now - self._asked >= self.interval_s:
            self._asked = now
            self._cancelling = self.store.status(self.record.id) == "cancelling"
        return self._cancelling or self.stopping() or self.clock() >= self.record.expires_at


def _expired(item: BatchRequest | LineError) -> LineError:
    if isinstance(item, LineError):
        return item  # it failed on its own; it says why
    return LineError(
        item.line, item.custom_id, "batch_expired",
        "This request could not be executed before the completion window expired.",
    )  # fmt: skip


def _file_error(code: str, message: str) -> dict[str, Any]:
    return {"code": code, "message": message, "param": None, "line": None}


class _NotBatchLines(logging.Filter):
    """Drops the log lines of each batch line's request (httpx's, the access log's): a batch
    of 50,000 requests would bury the log; the runner logs each batch's progress instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        http = getattr(record, "http", None)
        if isinstance(http, dict) and str(http.get("client", "")).startswith(_CLIENT + ":"):
            return False
        return not (record.name == "httpx" and "http://batch/" in record.getMessage())


def _quiet_lines() -> None:
    for name in ("httpx", "pipepool.access"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NotBatchLines) for f in logger.filters):
            logger.addFilter(_NotBatchLines())
