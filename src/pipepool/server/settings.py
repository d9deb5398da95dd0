"""What the server is told on the command line: where to listen and the limits that protect
it (what it calls its models: ``models.py``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidInputError
from .turns import FAIR_SHARES


@dataclass(frozen=True)
class ServerSettings:
    """Everything the HTTP server is told at start (address, limits, keys, logs); the limits
    on queued requests hold for each model it serves."""

    host: str = "127.0.0.1"  # loopback unless told otherwise: no accidental exposure
    port: int = 8000
    api_key: str | None = None  # None: no authentication
    # Token-id inputs are read as ids of this model's tokenizer; a client that sends ids of
    # another tokenizer (LangChain's OpenAIEmbeddings does by default) would get wrong vectors
    # with no error, so they are refused unless the operator says the clients' ids are right.
    allow_token_ids: bool = False
    # What one request may ask for (``limits.py``; each answered 400 or 413 naming its flag).
    max_inputs_per_request: int = 2048  # OpenAI's own limit on "input" list length
    # Tokens of one request, all its inputs (or pairs) together, after truncation: OpenAI's own
    # limit, so that what clients batch for OpenAI (langchain-openai does) is accepted whole.
    max_tokens_per_request: int = 300_000
    # Tokens of one input embedded whole with long_inputs="chunk" (a request's or the server's
    # --long-inputs): without it one text of a megabyte holds the model for minutes. 32k: any
    # document a 32k-context model reads in one pass. /tokenize counts texts up to it too.
    max_chunked_tokens: int = 32768
    max_body_bytes: int = 32 << 20  # checked from Content-Length and while reading
    # Engine requests (one per input) admitted by the server and not yet finished; above it a
    # request is answered 429. Never below max_inputs_per_request, so that any request the
    # server accepts can run once the queue has drained.
    max_queued_requests: int = 16384
    # A request that finds its model's queue full waits up to this long for room (in arrival
    # order) before its 429: a client that retries at once after a 429, whatever Retry-After
    # says, is held to a request a second on each connection, and is read and parsed that
    # often (``front.AsyncEngine._admit``). 0: refused at once.
    queue_wait_s: float = 1.0
    shutdown_timeout_s: float = 30.0  # how long SIGTERM waits for in-flight requests
    # An idle keep-alive connection is closed after this long. A client that sends on it just
    # as the server closes it sees a connection reset, so the server must outlast every
    # client's and proxy's own idle expiry (httpx/openai 5 s, aiohttp 15 s, nginx upstream and
    # AWS ALB 60 s): 75 s, nginx's own keepalive_timeout.
    timeout_keep_alive_s: float = 75.0
    backlog: int = 2048  # connections the kernel queues before accept (bursts of clients)
    # Slow clients (``connections.py``, ``guards.py``): a request's headers must be complete
    # this long after its first byte (or after the connection opened), else 408 and closed;
    # no wait for the next part of a body may be longer, and the whole body must arrive
    # within it plus a second per ``guards.MIN_BODY_RATE`` bytes, else 408 and closed. Without
    # them a client sending a byte a second holds a connection (and its memory) for hours.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    # Connections one client address may hold open in one front-end process; more are answered
    # 429 and closed at once. 0: no cap (behind a proxy every client has the proxy's address).
    # 512: twice the 256 concurrent connections the repository's own soak test opens.
    max_connections_per_client: int = 512
    # Whose turns the scheduler takes (``turns.py``): "client", every client address one turn
    # whatever its number of requests; "request", every request its own (behind a proxy).
    fair_share: str = "client"
    log_level: str = "info"
    log_format: str = "text"  # text | json
    access_log: bool = True
    # HTTP front-end processes sharing the replicas (``api_servers.py``): each parses,
    # tokenises, routes and serialises with a GIL of its own. Which one this process is: 0 for
    # the main process (it owns the replicas), 1 .. count - 1 for the others.
    api_server_count: int = 1
    api_server_index: int = 0
    # The Batch API's records and files (``batch_store.py``); None: ``default_state_dir()``.
    state_dir: str | None = None
    # What one batch may hold: OpenAI's own limits, so that a batch file made for OpenAI is
    # accepted whole.
    max_batch_requests: int = 50_000
    max_batch_file_bytes: int = 200 << 20
    # Uploads one front-end process receives at once (``upload_slots.py``): each streams to
    # disk in a few megabytes of memory; past this they wait --queue-wait, then 429.
    max_concurrent_uploads: int = 4
    # Remote images (``media_fetch.py``): http(s) URLs are fetched from these hosts only
    # (vLLM's --allowed-media-domains; none: every remote URL is refused), each within this
    # many seconds and bytes, redirects not followed: an image URL must not make the server a
    # proxy into its own network, nor hold a request or its memory.
    allowed_media_domains: tuple[str, ...] = ()
    media_fetch_timeout_s: float = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT default
    media_fetch_max_bytes: int = 20 << 20

    @property
    def batch_state_dir(self) -> Path:
        """Where the Batch API keeps its records and files."""
        return Path(self.state_dir).expanduser() if self.state_dir else default_state_dir()

    def __post_init__(self) -> None:
        positive = ("max_inputs_per_request", "max_tokens_per_request", "max_chunked_tokens")
        limits = ("max_body_bytes", "max_queued_requests", "max_batch_requests")
        for name in (*positive, *limits, "max_batch_file_bytes", "max_concurrent_uploads"):
            if getattr(self, name) < 1:
                raise InvalidInputError(f"{name} must be >= 1", param=name)
        if self.max_queued_requests < self.max_inputs_per_request:
            raise InvalidInputError(
                f"max_queued_requests={self.max_queued_requests} is below "
                f"max_inputs_per_request={self.max_inputs_per_request}: a full-size request "
                "could never be queued",
                param="max_queued_requests",
            )
        if not 0 <= self.port <= 65535:
            raise InvalidInputError(f"port must be in 0..65535, got {self.port}", param="port")
        if self.queue_wait_s < 0:
            raise InvalidInputError("queue_wait must be >= 0 (0: no wait)", param="queue_wait")
        if self.shutdown_timeout_s <= 0:
            raise InvalidInputError("shutdown_timeout must be > 0", param="shutdown_timeout")
        if self.fair_share not in FAIR_SHARES:
            raise InvalidInputError(
                f"fair_share must be one of {', '.join(FAIR_SHARES)}", param="fair_share"
            )
        if self.log_format not in ("text", "json"):
            raise InvalidInputError("log_format must be text or json", param="log_format")
        if self.timeout_keep_alive_s <= 0:
            raise InvalidInputError("timeout_keep_alive must be > 0", param="timeout_keep_alive")
        if self.backlog < 1:
            raise InvalidInputError("backlog must be >= 1", param="backlog")
        for name in ("header_timeout", "body_timeout"):
            if getattr(self, f"{name}_s") <= 0:
                raise InvalidInputError(f"{name} must be > 0", param=name)
        if self.max_connections_per_client < 0:
            raise InvalidInputError(
                "max_connections_per_client must be >= 0 (0: no cap)",
                param="max_connections_per_client",
            )
        if self.media_fetch_timeout_s <= 0:
            raise InvalidInputError("media_fetch_timeout must be > 0", param="media_fetch_timeout")
        if self.media_fetch_max_bytes < 1:
            raise InvalidInputError(
                "media_fetch_max_bytes must be >= 1", param="media_fetch_max_bytes"
            )
        if self.api_server_count < 1:
            raise InvalidInputError("api_server_count must be >= 1", param="api_server_count")
        if not 0 <= self.api_server_index < self.api_server_count:
            raise InvalidInputError("api_server_index out of range", param="api_server_index")
        if self.api_key is not None and not self.api_key:
            raise InvalidInputError("api_key is empty", param="api_key")


def default_state_dir() -> Path:
    """The user's data directory for pipepool (XDG: ``$XDG_DATA_HOME/pipepool``, else
    ``~/.local/share/pipepool``)."""
    base = os.environ.get("XDG_DATA_HOME") or "~/.local/share"
    return Path(base).expanduser() / "pipepool"
