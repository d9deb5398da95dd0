"""``SharedReplicas``: the engine of one more front-end process, over replicas it does not own.

With ``pipepool serve --api-server-count K``, the server's main process owns the replicas (a
``ReplicaPipeline`` with a ``socket_dir``: each replica also listens on a Unix socket) and
K - 1 more processes serve HTTP beside it, each with one of these. It is the same front end —
validation, tokenisation, routing by each replica's outstanding tokens (as this process
counts them), re-running a lost replica's rows on the others — over connections
(``handle.ReplicaLink``) instead of processes. The owner restarts a replica that died; here
its link is lost (its rows move to the other replicas, or wait), and a new link is made as
soon as the replacement listens. Giving up on a replica is the owner's decision: when every
replica is given up on, the main process exits, and this process with it.
"""

from __future__ import annotations

from .handle import ReplicaHandle, ReplicaLink
from .pipeline import ReplicaPipeline, replica_socket
from .slot import Slot

# How soon a lost link tries again: the owner restarts the replica after its own backoff, and
# the link connects as soon as the new process listens (it retries every 0.1 s until then).
_RELINK_DELAY_S = 0.2


class SharedReplicas(ReplicaPipeline):
    """The pipeline of one more front end: ``SharedReplicas(config, socket_dir)`` blocks
    until every replica has answered (they listen once they serve)."""

    def _start_replica(self, placement, cancelled=lambda: False) -> ReplicaHandle:
        assert self.socket_dir is not None, "shared replicas are found through their sockets"
        path = replica_socket(self.socket_dir, placement.index)
        return ReplicaLink(placement, self._listener, path, cancelled)

    def _restart_delay(self, slot: Slot) -> float | None:
        return _RELINK_DELAY_S  # never gives up: the owner bounds the restarts

    _restart_message = "replica %d: linking to its new process"
