"""One replica as the front end tracks it across its processes: state, work held, load,
restart budget, and counters carried over from the processes it had before."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from ..core.restarts import RestartPolicy
from ..driver.owners import Owner, Owners
from .handle import Rates, ReplicaHandle
from .messages import Snapshot
from .placement import ReplicaPlacement


class State(Enum):
    """Where a replica is in its life; only ``OK`` replicas are routed new work."""

    STARTING = "starting"
    OK = "ok"  # takes new work
    HEALING = "healing"  # its engine restarts a stage; its work was moved to the others
    RESTARTING = "restarting"  # its process died; a new one starts after a backoff
    FAILED = "failed"  # restarted too often: given up on


@dataclass(eq=False)
class Slot:
    """The front end's record of one replica: its placement, process handle, state, the work
    it holds (``owners``) and its restart policy. Guarded by the replica pipeline's lock."""

    placement: ReplicaPlacement
    policy: RestartPolicy  # the same bounds as a pipeline's own stage restarts
    proc: ReplicaHandle | None = None
    state: State = State.STARTING
    owners: Owners = field(default_factory=Owners)  # the batches it holds, by first id
    outstanding: int = 0  # prompt tokens sent and not yet answered (the routing load)
    restarts: int = 0  # times its process was started again
    error: BaseException | None = None  # why it last failed
    rates: Rates = field(default_factory=Rates)
    past: list[Snapshot] = field(default_factory=list)  # last counters of earlier processes

    @property
    def index(self) -> int:
        return self.placement.index

    def serving_proc(self) -> ReplicaHandle:
        """The process of a replica that takes work (state OK): it always has one."""
        assert self.proc is not None, f"replica {self.index} has no process"
        return self.proc

    def unfinished_tokens(self, owner: Owner) -> int:
        return int(owner.batch.lengths[~owner.done].sum())

    def retire_process(self) -> None:
        """Its process is gone: keep its counters (metrics stay monotonic), forget its rates."""
        if self.proc is not None:
            self.past.append(self.proc.snapshot)
        self.rates.reset()

    def snapshots(self) -> list[Snapshot]:
        current = [self.proc.snapshot] if self.proc is not None else []
        return self.past + current


def sum_field(snapshots: list[Snapshot], name: str):
    return sum(getattr(s, name) for s in snapshots)


def sum_buckets(snapshots: list[Snapshot], width: int) -> list[int]:
    total = np.zeros(width, dtype=np.int64)
    for s in snapshots:
        if len(s.step_time_buckets) == width:
            total += np.asarray(s.step_time_buckets, dtype=np.int64)
    return total.tolist()
