"""Finding each other: a TCPStore and this engine's own process groups.

On one host the driver hosts the store on a port the OS picks (port 0: two engines never
collide). Under ``torchrun`` the store is torchrun's (env:// variables) and every rank runs
the same command; rank 0 is the driver.
"""

from __future__ import annotations

import datetime
import functools
import os
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..runtime.signal_mask import stop_signals_blocked
from .dist_transport import Groups

# Failures are detected by the supervisor (process exits, error reports), not by timeouts:
# one step of a 32k-token document on a CPU may take minutes.
_GROUP_TIMEOUT = datetime.timedelta(hours=24)
_STORE_TIMEOUT = datetime.timedelta(seconds=300)


@dataclass(frozen=True)
class Rendezvous:
    """The pipeline's meeting point: a TCP store on port 0 with a unique key prefix, through
    which stages find each other and the driver's control plane runs."""

    host: str
    port: int
    world: int
    prefix: str  # unique per engine: keys and groups of two engines never mix
    torchrun: bool


@dataclass(frozen=True)
class TorchrunEnv:
    """The rank, world size and local rank a torchrun-style launcher gave this process."""

    rank: int
    world: int
    local_rank: int


def torchrun_env() -> TorchrunEnv | None:
    """The rank this process has under torchrun (or any env:// launcher), else None."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env or "MASTER_ADDR" not in env:
        return None
    return TorchrunEnv(
        int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"]))
    )


def host_store(world: int) -> tuple[dist.TCPStore, Rendezvous]:
    """Driver side, one host: a fresh store on a free loopback port."""
    store = dist.TCPStore(
        "127.0.0.1", 0, world, is_master=True, timeout=_STORE_TIMEOUT, wait_for_workers=False
    )
    return store, Rendezvous(
        "127.0.0.1", store.port, world, f"pipepool-{uuid.uuid4().hex[:12]}", False
    )


@functools.cache
def torchrun_store(env: TorchrunEnv) -> tuple[dist.Store, Rendezvous]:
    """torchrun's store, connected once per process (the deployment hand-off and the
    executor share it)."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(
        host,
        port,
        env.world,
        is_master=env.rank == 0 and not agent_hosts,
        timeout=_STORE_TIMEOUT,
        wait_for_workers=False,
    )
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    return store, Rendezvous(host, port, env.world, f"pipepool-{run_id}", True)


def connect_store(rdv: Rendezvous) -> dist.Store:
    return dist.TCPStore(rdv.host, rdv.port, rdv.world, is_master=False, timeout=_STORE_TIMEOUT)


def engine_store(store: dist.Store, rdv: Rendezvous) -> dist.Store:
    return dist.PrefixStore(rdv.prefix, store)


def make_groups(store: dist.Store, rdv: Rendezvous, rank: int, device: torch.device) -> Groups:
    with stop_signals_blocked():  # the groups' I/O threads start here and inherit the mask
        control = _gloo(dist.PrefixStore("control", store), rank, rdv)
        if device.type == "cuda":
            data = _nccl(dist.PrefixStore("data", store), rank, rdv.world)
        else:
            data = _gloo(dist.PrefixStore("data", store), rank, rdv)
    return Groups(rank=rank, world=rdv.world, control=control, data=data)


def _gloo(store: dist.Store, rank: int, rdv: Rendezvous):
    if rdv.torchrun:
        return dist.ProcessGroupGloo(store, rank, rdv.world, _GROUP_TIMEOUT)
    # torch's stub lacks _Options and the constructor that takes it; both exist at runtime.
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = _GROUP_TIMEOUT
    # Loopback explicitly: resolving the hostname may pick an interface the sandbox blocks.
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, rdv.world, options)


def _nccl(store: dist.Store, rank: int, world: int):
    # NVLink multicast stays off (shared machines); honoured by NCCL at communicator creation.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = _GROUP_TIMEOUT
    return dist.ProcessGroupNCCL(store, rank, world, options)
