"""A replica process: one pipeline of stages (``driver.local.LocalPipeline``) serving the token
batches of its front ends; it tokenises nothing (the front end did) and keeps no tokenizer.

``python -m pipepool.replicas.worker FD``: FD is this end of a socket pair the front end made.
Per front end (a ``ReplicaServer``): one thread reads frames and enqueues their batches (a
frame's consecutive works of one client as one call, ``work_groups``); the
pipeline's loop thread writes each step's finished rows into that front end's outbox; one sender
thread ships the outbox, with a snapshot of the pipeline's counters, as one frame — at once when
there are results, else every ``STATUS_INTERVAL_S`` and whenever the pipeline's health changes
(a stage died and is being restarted: the front end moves this replica's work elsewhere
meanwhile).

The front end that started the replica (its parent) owns it: its socket pair is served on the
main thread, and its Stop, or its going away, ends the process. With ``--api-server-count`` the
replica also accepts the other front-end processes' connections on a Unix socket
(``Start.listen_path``), once it is ready; one of those hanging up drops only its own work.

The replica dies with its parent and leaves its own stages no way to outlive it (they watch
their parent the same way).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from multiprocessing.connection import Connection

from ..core.priority import background_work, client_turns
from ..core.submission import Submission
from ..driver.local import LocalPipeline
from ..intake.inputs import TokenSlice, output_width
from ..parallel.worker import _die_with_parent
from ..runtime.collector import freeze_startup_objects
from ..runtime.memory import bound_heap_growth
from ..runtime.signal_mask import block_stop_signals
from .messages import (
    Abort,
    Ready,
    Report,
    Result,
    Snapshot,
    Start,
    StartFailed,
    Stop,
    TraceReply,
    TraceRequest,
    Work,
    receive,
    send,
)
from .work_groups import WorkGroup, group_works

STATUS_INTERVAL_S = 0.5
_HEALTH_POLL_S = 0.05  # how soon a health change (a stage died) reaches the front end
_MAX_MESSAGES = 1024  # read in one go at most: then they are queued, the rest after


class ReplicaServer:
    """One front end's session over the replica's pipeline. ``owner``: the parent's (its end
    closes the pipeline)."""

    def __init__(self, pipeline: LocalPipeline, conn: Connection, *, owner: bool = True) -> None:
        self.pipeline = pipeline
        self.conn = conn
        self.owner = owner
        # A work's first id -> the call it went into, with the works it shares it with.
        self._calls: dict[int, tuple[Submission, WorkGroup]] = {}
        self._outbox: deque[Result] = deque()
        self._replies: deque[TraceReply] = deque()  # sent ahead of the next report
        self._wake = threading.Condition()
        self._stop = False
        self._sender = threading.Thread(target=self._send_loop, name="replica-sender", daemon=True)

    def run(self) -> int:
        """Serve until the front end says stop or goes away; returns the exit code."""
        self._sender.start()
        self.pipeline.add_death_callback(lambda _cause: self._wake_sender())
        code = 0
        try:
            while True:
                messages = receive(self.conn)
                arrived = time.perf_counter()
                while len(messages) < _MAX_MESSAGES and self.conn.poll(0):
                    # Frames that came meanwhile (the front end sent while this thread waited
                    # for the interpreter): their works may share calls with these.
                    messages += receive(self.conn)
                works: list[Work] = []  # consecutive ones, queued together (``work_groups``)
                for message in messages:
                    if isinstance(message, Work):
                        works.append(message)
                        continue
                    if works:
                        self._queue(works, arrived)
                        works = []
                    if isinstance(message, Abort):
                        self._abort(message.first_ids)
                    elif isinstance(message, TraceRequest):
                        threading.Thread(
                            target=self._trace, args=(message,), name="replica-trace", daemon=True
                        ).start()
                    elif isinstance(message, Stop):
                        return 0
                if works:
                    self._queue(works, arrived)
        except (EOFError, OSError):
            code = 1  # the front end is gone: nobody to answer
        finally:
            if self.owner:
                self.pipeline.close()  # the front end writes the trace
            else:  # another front end hung up: its work here has nobody to go to
                self._abort(tuple(self._calls.copy()))  # copy(): atomic
            with self._wake:
                self._stop = True
                self._wake.notify()
            self._sender.join(timeout=5)
        return code

    def _queue(self, works: list[Work], arrived: float) -> None:
        """Enqueue ``works`` (their frame read at ``arrived``, ``time.perf_counter``) as calls
        (``work_groups``); their outputs go to the sender as steps finish them."""
        for group in group_works(works, self.pipeline.light_tokens):
            self._call(group, arrived)

    def _call(self, group: WorkGroup, arrived: float) -> None:
        def forward(rows, values) -> None:
            results = group.results(rows, values, time.perf_counter() - arrived)
            if results:
                with self._wake:
                    self._outbox.extend(results)
                    self._wake.notify()

        try:
            with (
                background_work() if group.background else contextlib.nullcontext(),
                client_turns(group.client),
            ):
                # ``forward`` goes in with the work: a step may finish it before this returns.
                # The front end checked the batch (key lengths included) before sending it.
                params = group.params
                submission = Submission(
                    params,
                    len(group),
                    params.dimensions or output_width(self.pipeline.deployment, params.pooling),
                    on_cancel=self.pipeline.cancel,
                    background=group.background,
                    client=group.client,
                    on_result=forward,
                )
                part = TokenSlice(
                    0, group.token_ids, group.lengths, group.type_ids, group.key_lens,
                    group.media, group.images,
                )  # fmt: skip
                self.pipeline.enqueue(submission, part)
        except Exception:
            return  # the pipeline is dead: the next snapshot says so, the front end re-runs it
        for first_id in group.first_ids:
            self._calls[first_id] = (submission, group)

        def forget(_f) -> None:
            for first_id in group.first_ids:
                self._calls.pop(first_id, None)

        submission.add_done_callback(forget)

    def _abort(self, first_ids: tuple[int, ...]) -> None:
        for first_id in first_ids:
            call = self._calls.pop(first_id, None)
            if call is not None and call[1].drop(first_id):
                call[0].cancel()  # no work of its group is wanted any more

    def _trace(self, request: TraceRequest) -> None:
        """Gather the pipeline's spans (waiting for its steps in flight) and send them."""
        try:
            (traces,) = self.pipeline.gather_trace(request.timeout_s)
            reply = TraceReply(request.token, traces)
        except BaseException as exc:
            reply = TraceReply(request.token, None, _picklable(exc))
        with self._wake:
            self._replies.append(reply)
            self._wake.notify()

    def _wake_sender(self) -> None:
        with self._wake:
            self._wake.notify()

    def _send_loop(self) -> None:
        last_health, waited = None, 0.0
        while True:
            with self._wake:
                if not self._outbox and not self._replies and not self._stop:
                    self._wake.wait(_HEALTH_POLL_S)
                results, self._outbox = list(self._outbox), deque()
                replies, self._replies = list(self._replies), deque()
                stopping = self._stop
            health = self.pipeline.health
            waited += _HEALTH_POLL_S if not results else 0.0
            if (
                results or replies or health != last_health or waited >= STATUS_INTERVAL_S
                or stopping
            ):  # fmt: skip
                waited, last_health = 0.0, health
                try:
                    send(self.conn, [*replies, Report(results, snapshot(self.pipeline))])
                except OSError:
                    return
            if stopping or health == "dead":
                if health == "dead" and not stopping:
                    # Nothing more can be computed here: exit, so the front end re-runs this
                    # replica's work elsewhere and starts it afresh.
                    os._exit(1)
                return


def snapshot(pipeline: LocalPipeline) -> Snapshot:
    s = pipeline.stats.snapshot()
    dead = pipeline.cause_of_death
    return Snapshot(
        health=pipeline.health,
        requests_finished=s.requests_finished,
        prompt_tokens_finished=s.prompt_tokens_finished,
        steps=s.steps,
        scheduled_tokens=s.scheduled_tokens,
        chunked_requests=s.chunked_requests,
        queue_waiting=s.queue_waiting,
        requests_running=s.requests_running,
        pipeline_restarts=s.pipeline_restarts,
        requests_retried=s.requests_retried,
        step_time_sum=s.step_time_sum,
        step_time_count=s.step_time_count,
        step_time_buckets=tuple(s.step_time_buckets),
        stage_busy_s=tuple(s.stage_busy_s),
        errors=dict(s.errors),
        kv_blocks_free=pipeline.kv_blocks_free,
        cause=None if dead is None else str(dead),
    )


def main(argv: list[str] | None = None) -> None:
    _die_with_parent()
    # The front end owns shutdown (Ctrl-C, SIGTERM to the process group): it stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fd = int((argv if argv is not None else sys.argv[1:])[0])
    conn = Connection(fd)
    (start,) = receive(conn)
    assert isinstance(start, Start)
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s replica {start.index}: %(message)s"
    )
    if start.config.cpu_threads is not None:
        import torch

        # Our share of the host's cores (a pipeline of stage processes splits it further).
        torch.set_num_threads(start.config.cpu_threads)
    try:
        bound_heap_growth()  # before the first large block: RSS stays flat however long we run
        pipeline = LocalPipeline(start.config)
        # A replica reports ready compiled: the front end routes by load, not by speed.
        pipeline.wait_until_compiled(None)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            send(conn, [StartFailed(_picklable(exc))])
        os._exit(1)
    send(conn, [Ready(pipeline.deployment, os.getpid())])
    freeze_startup_objects()
    if start.listen_path is not None:
        accept_front_ends(pipeline, start.listen_path)
    code = ReplicaServer(pipeline, conn).run()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def accept_front_ends(pipeline: LocalPipeline, path: str) -> None:
    """Serve every front end that connects to ``path`` (a thread each), from now on."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # left by the process this one replaces
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)

    def serve(conn: Connection) -> None:
        block_stop_signals()
        try:
            send(conn, [Ready(pipeline.deployment, os.getpid())])
        except OSError:
            return
        ReplicaServer(pipeline, conn, owner=False).run()
        conn.close()

    def accept() -> None:
        block_stop_signals()
        while True:
            sock, _ = listener.accept()
            conn = Connection(sock.detach())
            threading.Thread(target=serve, args=(conn,), name="front-end", daemon=True).start()

    threading.Thread(target=accept, name="front-end-listener", daemon=True).start()


def _picklable(exc: BaseException) -> BaseException:
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    # Through the package module, so what we pickle names classes the front end can import.
    from pipepool.replicas import worker

    worker.main()
