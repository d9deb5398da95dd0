"""Counters of a replicated engine: the front end's own plus its replicas', and one status
line per replica for ``/metrics``."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..core.stats import STEP_BUCKETS, EngineStats
from .slot import Slot, sum_buckets, sum_field

# Counters summed over every process a replica had (a restarted one counts from zero).
_SUMMED = ("steps", "scheduled_tokens", "chunked_requests", "step_time_sum", "step_time_count")


@dataclass(frozen=True)
class ReplicaStatus:
    """One replica as ``Engine.replica_status()`` and ``/health`` report it: state, process,
    devices, load and recent throughput."""

    index: int
    state: str  # starting | ok | healing | restarting | failed
    pid: int | None
    devices: tuple[str, ...]
    outstanding_tokens: int  # routed to it, not yet answered
    queue_waiting: int  # requests waiting in its scheduler
    requests_running: int
    tokens_per_s: float  # prompt tokens finished per second, last ~10 s
    busy_fraction: float  # mean share of wall time its stages computed, last ~10 s
    restarts: int  # its process started again after it died
    pipeline_restarts: int  # its engine restarted failed stages itself
    prompt_tokens_finished: int


def replica_status(slot: Slot) -> ReplicaStatus:
    snaps = slot.snapshots()
    current = slot.proc.snapshot if slot.proc is not None else None
    return ReplicaStatus(
        index=slot.index,
        state=slot.state.value,
        pid=slot.proc.pid if slot.proc is not None else None,
        devices=slot.placement.devices,
        outstanding_tokens=slot.outstanding,
        queue_waiting=current.queue_waiting if current else 0,
        requests_running=current.requests_running if current else 0,
        tokens_per_s=slot.rates.tokens_per_s(),
        busy_fraction=slot.rates.busy_fraction(),
        restarts=slot.restarts,
        pipeline_restarts=sum_field(snaps, "pipeline_restarts"),
        prompt_tokens_finished=sum_field(snaps, "prompt_tokens_finished"),
    )


def merged_stats(front: EngineStats, slots: list[Slot]) -> EngineStats:
    """A fresh EngineStats: requests and tokens as the front end counted them (a row run
    twice after a failure counts once), steps and queues as the replicas report them."""
    busy: list[float] = []
    out = EngineStats(num_stages=0)
    errors: Counter = Counter(front.errors)
    for field_name in (
        "requests_submitted", "requests_finished", "requests_aborted",
        "prompt_tokens_submitted", "prompt_tokens_finished", "requests_retried",
    ):  # fmt: skip
        setattr(out, field_name, getattr(front, field_name))
    for slot in slots:
        snaps = slot.snapshots()
        for name in _SUMMED:
            setattr(out, name, getattr(out, name) + sum_field(snaps, name))
        out.pipeline_restarts += slot.restarts + sum_field(snaps, "pipeline_restarts")
        out.requests_retried += sum_field(snaps, "requests_retried")
        for s in snaps:
            errors.update(s.errors)
        buckets = sum_buckets(snaps, len(STEP_BUCKETS))
        out.step_time_buckets = [a + b for a, b in zip(out.step_time_buckets, buckets, strict=True)]
        if slot.proc is not None:
            out.queue_waiting += slot.proc.snapshot.queue_waiting
            out.requests_running += slot.proc.snapshot.requests_running
            busy += slot.proc.snapshot.stage_busy_s
        else:
            busy += [0.0] * len(slot.placement.devices)
    out.num_stages = len(busy)
    out.stage_busy_s = busy
    out.errors = errors
    return out
