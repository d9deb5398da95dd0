"""``/metrics`` per replica of a data-parallel engine (``--dp N``): one series per replica,
labelled ``replica="k"``."""

from __future__ import annotations

from collections.abc import Sequence

from ..replicas.stats import ReplicaStatus

# (metric, kind, help, the ReplicaStatus field it reads)
_SERIES = (
    ("pipepool_replica_up", "gauge", "1 while the replica takes work", None),
    (
        "pipepool_replica_outstanding_tokens", "gauge",
        "prompt tokens routed to the replica and not yet answered", "outstanding_tokens",
    ),
    (
        "pipepool_replica_queue_waiting_requests", "gauge",
        "requests waiting in the replica's scheduler", "queue_waiting",
    ),
    (
        "pipepool_replica_running_requests", "gauge",
        "requests admitted by the replica's scheduler, not finished", "requests_running",
    ),
    (
        "pipepool_replica_tokens_per_second", "gauge",
        "prompt tokens the replica finished per second (last ~10 s)", "tokens_per_s",
    ),
    (
        "pipepool_replica_busy_fraction", "gauge",
        "share of wall time the replica's stages computed, mean over its stages (last ~10 s)",
        "busy_fraction",
    ),
    (
        "pipepool_replica_prompt_tokens_finished_total", "counter",
        "prompt tokens of requests the replica finished", "prompt_tokens_finished",
    ),
    (
        "pipepool_replica_restarts_total", "counter",
        "times the replica's process died and was started again", "restarts",
    ),
    (
        "pipepool_replica_pipeline_restarts_total", "counter",
        "times the replica restarted failed stage processes itself", "pipeline_restarts",
    ),
)  # fmt: skip


def replica_metrics(out, replicas: Sequence[ReplicaStatus]) -> None:
    for name, kind, help, attr in _SERIES:
        samples = []
        for r in replicas:
            value = int(r.state == "ok") if attr is None else getattr(r, attr)
            samples.append(({"replica": str(r.index)}, value))
        out.family(name, kind, help, samples)
    out.family(
        "pipepool_replica_info",
        "gauge",
        "where each replica runs (state, devices, pid)",
        [
            (
                {
                    "replica": str(r.index),
                    "state": r.state,
                    "devices": ",".join(r.devices),
                    "pid": str(r.pid or ""),
                },
                1,
            )
            for r in replicas
        ],
    )
