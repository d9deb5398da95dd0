"""``/metrics`` in the Prometheus text format: each model's engine counters (``Engine.stats``),
KV blocks and queue, and what the HTTP layer sees (requests by route and status, latency,
errors sent, aborts). A server of several models labels each model's series ``model="NAME"``
(the name its responses carry), and its HTTP requests by the model that answered; one of a
single model keeps them unlabelled. Written by hand: a few dozen lines do not justify a
dependency."""

from __future__ import annotations

import gc
import logging
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import quote

from ..api.engine import Engine
from ..core.stats import STEP_BUCKETS
from .errors import APIError
from .front import AsyncEngine
from .health import ComponentHealth
from .models import ServedModels

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# One line per request answered (not uvicorn.access: uvicorn silences that one when its own
# access log is off, and it is always off here).
access = logging.getLogger("pipepool.access")

HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _Histogram:
    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * len(self.bounds)  # cumulative, as Prometheus wants
        self.count = 0
        self.sum = 0.0

    def add(self, other: _Histogram) -> None:
        """Count ``other``'s observations in this one too (same bounds)."""
        assert other.bounds == self.bounds
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.count += other.count
        self.sum += other.sum

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1


@dataclass
class ConnectionCounts:
    """What the connection guards (``connections.py``) count, for /metrics. Updated on the
    event loop thread only."""

    open: int = 0  # connections admitted and not yet closed
    refused: int = 0  # closed at once: their address held --max-connections-per-client
    header_timeouts: int = 0  # closed: a request's headers took over --header-timeout


class HttpMetrics:
    """What the server itself counts. Updated on the event loop thread only.

    Each of ``routes`` (the app's paths) gets its own label; any other path is "other", so a
    scanner probing random paths cannot blow up the number of series. A request is counted
    under the model that answered it ("" where none did: /health, a 404)."""

    def __init__(self, routes: frozenset[str]) -> None:
        self.routes = routes
        self.requests: Counter[tuple[str, int, str]] = Counter()  # (route, status, model)
        self.errors: Counter[tuple[str, str]] = Counter()  # (error type, error code)
        self.latency: dict[tuple[str, str], _Histogram] = {}  # by (route, model)
        self.in_flight = 0
        self.connections = ConnectionCounts()

    def on_error(self, err: APIError) -> None:
        self.errors[(err.type, err.code or "")] += 1

    def on_response(self, path: str, status: int, seconds: float, model: str = "") -> None:
        route = path if path in self.routes else "other"
        self.requests[(route, status, model)] += 1
        self.latency.setdefault((route, model), _Histogram(HTTP_BUCKETS)).observe(seconds)


def log_access(scope, status: int, seconds: float) -> None:
    """uvicorn's access line, with the time from the request's arrival to its last byte."""
    client = scope.get("client")
    where = f"{client[0]}:{client[1]}" if client else "-"
    target = quote(scope.get("root_path", "") + scope["path"])  # as uvicorn writes it
    if scope.get("query_string"):
        target += "?" + scope["query_string"].decode("ascii", errors="replace")
    ms = round(seconds * 1000, 1)
    fields = {"client": where, "method": scope["method"], "path": target, "status": status}
    access.info(
        '%s - "%s %s HTTP/%s" %d %.1f ms', where, scope["method"], target,
        scope.get("http_version", "1.1"), status, ms, extra={"http": {**fields, "latency_ms": ms}},
    )  # fmt: skip


def render(
    models: ServedModels, http: HttpMetrics, components: dict[str, ComponentHealth] | None = None
) -> str:
    """The text of /metrics; ``components``: the server's other components' health
    (``health.HealthChecks``)."""
    out = _Text()
    several = len(models) > 1
    for model in models:
        _model_metrics(out.labelled(model=model.name) if several else out, model.front)
    _http_metrics(out, http, by_model=several)
    if components:
        out.family(
            "pipepool_component_ok",
            "gauge",
            "1 while a component other than the models (the batch store) works, 0 while it is "
            "degraded (/health says why)",
            [({"component": name}, int(c.ok)) for name, c in sorted(components.items())],
        )
    return out.text()


def _model_metrics(out: _Text, front: AsyncEngine) -> None:
    engine = front.owner.engine
    out.gauge(
        "pipepool_engine_ready", "1 when the engine is loaded and alive", engine_ready(engine)
    )
    if engine is not None:
        _engine_metrics(out, engine)
    out.gauge("pipepool_server_pending_inputs", "inputs admitted, not yet answered", front.pending)
    out.gauge(
        "pipepool_server_waiting_inputs",
        "inputs of requests waiting for room in the queue (--queue-wait)",
        front.waiting,
    )
    out.gauge(
        "pipepool_server_max_queued_requests",
        "limit on pending inputs (past it a request waits --queue-wait, then 429)",
        front.max_queued,
    )
    out.counter(
        "pipepool_server_aborted_http_requests_total",
        "HTTP requests whose engine requests were aborted (client left)",
        front.aborted_http_requests,
    )
    out.counter(
        "pipepool_server_aborted_inputs_total",
        "engine requests aborted because their HTTP request went away",
        front.aborted_inputs,
    )
    out.counter(
        "pipepool_server_joined_calls_total",
        "engine calls made for several one-text requests of one event-loop turn",
        front.joined.calls,
    )
    out.counter(
        "pipepool_server_joined_requests_total",
        "one-text requests answered by such a joined engine call",
        front.joined.requests,
    )


def _http_metrics(out: _Text, http: HttpMetrics, *, by_model: bool) -> None:
    out.gauge("pipepool_http_requests_in_flight", "HTTP requests being handled", http.in_flight)
    out.gauge("pipepool_http_connections_open", "HTTP connections open", http.connections.open)
    out.counter(
        "pipepool_http_connections_refused_total",
        "connections answered 429 and closed at once: their client address already held "
        "--max-connections-per-client",
        http.connections.refused,
    )
    out.counter(
        "pipepool_http_header_timeouts_total",
        "connections answered 408 and closed: a request's headers were not complete within "
        "--header-timeout (slow bodies: pipepool_http_errors_total code request_timeout)",
        http.connections.header_timeouts,
    )
    out.counter(
        "process_cpu_seconds_total",
        "CPU time of the front-end process that answered (near 1 s a second: it is the limit; "
        "see --api-server-count)",
        time.process_time(),
    )
    # prometheus_client's names: a full collection (generation 2) pauses every request of the
    # process (``runtime.collector.QuietCollections``).
    stats = gc.get_stats()
    out.family(
        "python_gc_collections_total",
        "counter",
        "collections of the front-end process's cycle collector, by generation",
        [({"generation": str(g)}, s["collections"]) for g, s in enumerate(stats)],
    )
    out.family(
        "python_gc_objects_collected_total",
        "counter",
        "objects the front-end process's cycle collector freed, by generation",
        [({"generation": str(g)}, s["collected"]) for g, s in enumerate(stats)],
    )
    # One model: its requests and those no model answered (a 404, a body that failed to
    # parse) share their series, which carry no model label; each is written once.
    requests: Counter[tuple[str, int, str]] = Counter()
    for (route, status, model), n in http.requests.items():
        requests[(route, status, model if by_model else "")] += n
    latency: dict[tuple[str, str], _Histogram] = {}
    for (route, model), hist in http.latency.items():
        key = (route, model if by_model else "")
        latency.setdefault(key, _Histogram(hist.bounds)).add(hist)
    out.family(
        "pipepool_http_requests_total",
        "counter",
        "HTTP requests answered, by route, status and (of several models) model",
        [
            ({"route": r, "status": str(s), **({"model": m} if by_model else {})}, n)
            for (r, s, m), n in sorted(requests.items())
        ],
    )
    out.family(
        "pipepool_http_errors_total",
        "counter",
        "error bodies sent, by OpenAI error type and code",
        [({"type": t, "code": c}, n) for (t, c), n in sorted(http.errors.items())],
    )
    out.header("pipepool_http_request_duration_seconds", "histogram", "HTTP request latency")
    for (route, model), hist in sorted(latency.items()):
        out.histogram_samples(
            "pipepool_http_request_duration_seconds",
            hist.bounds,
            hist.counts,
            hist.count,
            hist.sum,
            {"route": route, **({"model": model} if by_model else {})},
        )


def engine_ready(engine: Engine | None) -> int:
    """1 when the engine serves at full health (0 while loading, restarting, or dead)."""
    return int(engine is not None and engine.health == "ok")


def _engine_metrics(out: _Text, engine: Engine) -> None:
    s = engine.stats
    out.counter(
        "pipepool_requests_submitted_total",
        "engine requests (inputs) submitted",
        s.requests_submitted,
    )
    out.counter("pipepool_requests_finished_total", "engine requests finished", s.requests_finished)
    out.counter("pipepool_requests_aborted_total", "engine requests aborted", s.requests_aborted)
    out.counter(
        "pipepool_prompt_tokens_submitted_total",
        "prompt tokens submitted",
        s.prompt_tokens_submitted,
    )
    out.counter(
        "pipepool_prompt_tokens_finished_total",
        "prompt tokens of finished requests",
        s.prompt_tokens_finished,
    )
    out.counter("pipepool_steps_total", "step plans scheduled", s.steps)
    out.counter(
        "pipepool_scheduled_tokens_total", "tokens scheduled over all steps", s.scheduled_tokens
    )
    out.counter(
        "pipepool_chunked_requests_total",
        "requests whose prompt took more than one step",
        s.chunked_requests,
    )
    out.gauge(
        "pipepool_queue_waiting_requests", "engine requests waiting for admission", s.queue_waiting
    )
    out.gauge(
        "pipepool_running_requests", "engine requests admitted, not finished", s.requests_running
    )
    out.counter(
        "pipepool_pipeline_restarts_total",
        "times a failed pipeline (a stage process died) was started again",
        s.pipeline_restarts,
    )
    out.counter(
        "pipepool_requests_retried_total",
        "unfinished engine requests run again after a pipeline restart",
        s.requests_retried,
    )
    buckets = list(s.step_time_buckets)
    out.header(
        "pipepool_step_time_seconds", "histogram", "device time of each step (its slowest stage)"
    )
    out.histogram_samples(
        "pipepool_step_time_seconds", STEP_BUCKETS, buckets, s.step_time_count, s.step_time_sum, {}
    )
    out.family(
        "pipepool_stage_busy_seconds_total",
        "counter",
        "cumulative compute time per pipeline stage",
        [({"stage": str(k)}, busy) for k, busy in enumerate(s.stage_busy_s)],
    )
    out.family(
        "pipepool_engine_errors_total",
        "counter",
        "engine failures, by exception class",
        [({"kind": kind}, n) for kind, n in sorted(s.errors.items())],
    )
    free = engine.pipeline.kv_blocks_free
    if free is not None:  # encoders keep no KV cache
        out.gauge("pipepool_kv_blocks_free", "KV-cache blocks free", free)
        out.gauge("pipepool_kv_blocks_total", "KV-cache blocks", engine.pipeline.kv_blocks_total)
    replicas = engine.pipeline.replica_status()  # empty for one pipeline
    if replicas:
        from .replica_metrics import replica_metrics

        replica_metrics(out, replicas)


class _Text:
    """Metric families in the text format, each written once (HELP, TYPE, then its samples)
    however many models add samples to it; ``labelled`` adds labels to every sample."""

    def __init__(self, labels: dict | None = None, families: dict | None = None) -> None:
        self.labels = labels or {}
        self.families: dict[str, list[str]] = {} if families is None else families

    def labelled(self, **labels: str) -> _Text:
        """The same families, with ``labels`` on every sample added through the result."""
        return _Text({**self.labels, **labels}, self.families)

    def header(self, name: str, kind: str, help: str) -> None:
        self.families.setdefault(name, [f"# HELP {name} {help}", f"# TYPE {name} {kind}"])

    def family(
        self, name: str, kind: str, help: str, samples: Iterable[tuple[dict, float]]
    ) -> None:
        self.header(name, kind, help)
        self.families[name] += [
            f"{name}{_labels({**self.labels, **labels})} {_number(v)}" for labels, v in samples
        ]

    def counter(self, name: str, help: str, value: float) -> None:
        self.family(name, "counter", help, [({}, value)])

    def gauge(self, name: str, help: str, value: float) -> None:
        self.family(name, "gauge", help, [({}, value)])

    def histogram_samples(self, name, bounds, cumulative, count, total, labels: dict) -> None:
        """Samples of the histogram ``name`` (its ``header`` first)."""
        labels = {**self.labels, **labels}
        lines = self.families[name]
        for bound, n in zip(bounds, cumulative, strict=True):
            lines.append(f"{name}_bucket{_labels({**labels, 'le': _number(bound)})} {n}")
        lines.append(f"{name}_bucket{_labels({**labels, 'le': '+Inf'})} {count}")
        lines.append(f"{name}_sum{_labels(labels)} {_number(total)}")
        lines.append(f"{name}_count{_labels(labels)} {count}")

    def text(self) -> str:
        return "\n".join(line for lines in self.families.values() for line in lines) + "\n"


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _escape(value) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return repr(float(value))
