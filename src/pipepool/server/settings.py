"""What the server is told on the command line: where to listen, what to call the model,
and the limits that protect it."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidInputError

# What a client calls the bundled model when the server was started without --model.
DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"  # loopback unless told otherwise: no accidental exposure
    port: int = 8000
    api_key: str | None = None  # None: no authentication
    model_name: str = DEFAULT_MODEL_NAME  # the one name clients may pass as "model"
    max_inputs_per_request: int = 2048  # OpenAI's own limit on "input" list length
    max_body_bytes: int = 32 << 20  # checked from Content-Length and while reading
    # Engine requests (one per input) admitted by the server and not yet finished; above it a
    # request is answered 429. Never below max_inputs_per_request, so that any request the
    # server accepts can run once the queue has drained.
    max_queued_requests: int = 16384
    shutdown_timeout_s: float = 30.0  # how long SIGTERM waits for in-flight requests
    # An idle keep-alive connection is closed after this long. A client that sends on it just
    # as the server closes it sees a connection reset, so the server must outlast every
    # client's and proxy's own idle expiry (httpx/openai 5 s, aiohttp 15 s, nginx upstream and
    # AWS ALB 60 s): 75 s, nginx's own keepalive_timeout.
    timeout_keep_alive_s: float = 75.0
    backlog: int = 2048  # connections the kernel queues before accept (bursts of clients)
    log_level: str = "info"
    access_log: bool = True

    def __post_init__(self) -> None:
        for name in ("max_inputs_per_request", "max_body_bytes", "max_queued_requests"):
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
        if self.shutdown_timeout_s <= 0:
            raise InvalidInputError("shutdown_timeout must be > 0", param="shutdown_timeout")
        if self.timeout_keep_alive_s <= 0:
            raise InvalidInputError("timeout_keep_alive must be > 0", param="timeout_keep_alive")
        if self.backlog < 1:
            raise InvalidInputError("backlog must be >= 1", param="backlog")
        if self.api_key is not None and not self.api_key:
            raise InvalidInputError("api_key is empty", param="api_key")
