"""What crosses the socket between the front end and a replica process.

Every frame is one pickled list of messages (protocol 5: arrays travel as raw bytes), so a busy
front end sends many batches, and a busy replica many results, per system call. Requests are
token ids, already validated by the front end; results are arrays, never Python objects per
token.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import numpy as np

from ..config import EngineConfig
from ..core.request import PoolingParams

if TYPE_CHECKING:
    from ..loading.deployment import Deployment

# -- front end -> replica ---------------------------------------------------------------------


@dataclass(frozen=True)
class Start:
    """The first message a replica reads: what to build."""

    index: int  # the replica's number, for its log lines
    config: EngineConfig  # data_parallel_size 1: one pipeline
    # Where to accept the connections of other front-end processes once ready (a Unix
    # socket; ``--api-server-count``); None: this socket pair is the only front end.
    listen_path: str | None = None


@dataclass(frozen=True)
class Work:
    """Prompts ``first_id .. first_id + len(lengths) - 1``, back to back."""

    first_id: int
    token_ids: np.ndarray  # [sum(lengths)] int64
    lengths: np.ndarray  # [n] int64
    params: PoolingParams
    type_ids: np.ndarray | None = None  # token types of pair inputs; None: all 0
    key_lens: np.ndarray | None = None  # keys per prompt (RequestBatch.key_lens); None: all
    background: bool = False  # batch-job work (RequestBatch.background)
    client: str | None = None  # whose turns it takes (core.priority.client_turns)
    # Vision-language prompts (RequestBatch.media / .images): media rows parallel to
    # token_ids and each prompt's preprocessed images; None for text models.
    media: np.ndarray | None = None
    images: list | None = None


@dataclass(frozen=True)
class Abort:
    """Drop what is left of these batches (their rows run elsewhere, or nobody waits)."""

    first_ids: tuple[int, ...]


@dataclass(frozen=True)
class Stop:
    """Close the engine and exit."""


@dataclass(frozen=True)
class TraceRequest:
    """Send the spans of every process of this replica's pipeline (``TraceReply``)."""

    token: int  # names the reply
    timeout_s: float | None


# -- replica -> front end ---------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """A replica process's first message: its engine is loaded (with the deployment as the
    replica sees its devices) and it takes work."""

    deployment: Deployment  # devices as that replica sees them
    pid: int


@dataclass(frozen=True)
class StartFailed:
    """A replica process's first message when its engine could not start: the error, to be
    raised at the front (a bad model fails the whole engine's start)."""

    error: BaseException


@dataclass(frozen=True)
class Result:
    """Rows ``rows`` (of batch ``first_id``) finished with these outputs."""

    first_id: int
    rows: np.ndarray  # [k] int64, row indices within the batch
    values: np.ndarray | list  # [k, dim] float32, or k token arrays (ALL pooling)
    # Seconds from the batch's frame reaching the replica to these outputs (its queue and
    # steps there): the rest of the front end's wait is the way there and back.
    replica_s: float = 0.0


@dataclass(frozen=True)
class Snapshot:
    """The replica's engine counters and health when the frame left (metrics, routing)."""

    health: str  # ok | degraded | dead | closed
    requests_finished: int = 0
    prompt_tokens_finished: int = 0
    steps: int = 0
    scheduled_tokens: int = 0
    chunked_requests: int = 0
    queue_waiting: int = 0
    requests_running: int = 0
    pipeline_restarts: int = 0
    requests_retried: int = 0
    step_time_sum: float = 0.0
    step_time_count: int = 0
    step_time_buckets: tuple[int, ...] = ()
    stage_busy_s: tuple[float, ...] = ()
    errors: dict[str, int] = field(default_factory=dict)
    kv_blocks_free: int | None = None
    cause: str | None = None  # why the engine died, when it did


@dataclass(frozen=True)
class TraceReply:
    """The replica's answer to ``TraceRequest``: its processes' spans, or why none came."""

    token: int
    traces: list | None  # [ProcessTrace], on the replica's host clock
    error: BaseException | None = None


@dataclass(frozen=True)
class Report:
    """A replica's frame: the results since the last one, and its counters now."""

    results: list[Result]
    snapshot: Snapshot


# -- framing ----------------------------------------------------------------------------------


def send(conn: Connection, messages: list) -> None:
    conn.send_bytes(pickle.dumps(messages, protocol=5))


def receive(conn: Connection) -> list:
    """The next frame's messages; EOFError or OSError once the other side is gone."""
    return pickle.loads(conn.recv_bytes())
