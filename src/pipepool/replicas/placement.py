"""Where each replica runs: its GPUs (replica-major), or its share of the CPU cores.

GPU: replica r of a PP-stage pipeline takes devices ``g*PP .. g*PP+PP-1`` with
``g = r // replicas_per_gpu`` — replica-major, so each pipeline's stages sit on neighbouring
devices (NVLink peers on most hosts). The replica process sees only those devices
(``CUDA_VISIBLE_DEVICES``), so everything inside it is the ordinary one-pipeline engine, and
replicas sharing GPUs budget their share of the free memory for the KV cache.

CPU: each replica's stages split its share of the host's cores as threads (``cpu_threads``),
so N replicas do not oversubscribe the cores between them. They are not pinned: on a host
shared with other work, a pinned replica waits for its core while another one idles (a tiny
encoder at DP=2 on two cores busy with other jobs ran 2-4x slower pinned than unpinned).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..config import EngineConfig
from ..errors import InvalidInputError
from ..runtime.cores import usable_cpus


@dataclass(frozen=True)
class ReplicaPlacement:
    """Where one replica runs: its index, its stages' devices (or CPU threads) and the config
    its engine is built from."""

    index: int
    devices: tuple[str, ...]  # one per stage, as this host names them (cuda:3, cpu)
    visible_devices: str | None  # CUDA_VISIBLE_DEVICES of the replica process; None on CPU
    config: EngineConfig  # what the replica builds: one pipeline

    def describe(self) -> str:
        stages = len(self.devices)
        where = ", ".join(f"stage {k} -> {dev}" for k, dev in enumerate(self.devices))
        threads = self.config.cpu_threads
        cpu = f" ({threads} CPU thread(s))" if self.visible_devices is None and threads else ""
        return f"replica {self.index}: {stages} stage(s): {where}{cpu}"


def plan_placement(config: EngineConfig) -> list[ReplicaPlacement]:
    """One placement per replica; raises InvalidInputError naming what is missing."""
    if _under_torchrun():
        raise InvalidInputError(
            "data_parallel_size > 1 runs replicas on this host; under torchrun run one pipeline "
            "across hosts (--pp) and, for more throughput, one server per host behind a load "
            "balancer",
            param="data_parallel_size",
        )
    dp, pp = config.data_parallel_size, config.pipeline_parallel_size
    share = config.replicas_per_gpu
    one = config.replace(data_parallel_size=1, replicas_per_gpu=1)
    if _device_kind(config.device) == "cpu":
        one = one.replace(device="cpu")
        return [
            ReplicaPlacement(r, ("cpu",) * pp, None, one.replace(cpu_threads=threads))
            for r, threads in enumerate(_cpu_shares(dp))
        ]
    physical = visible_gpus()
    groups = -(-dp // share)  # GPU groups of PP devices
    if groups * pp > len(physical):
        raise InvalidInputError(
            f"data_parallel_size={dp} x pipeline_parallel_size={pp} with replicas_per_gpu="
            f"{share} needs {groups * pp} GPUs, {len(physical)} visible",
            param="data_parallel_size",
        )
    out = []
    for r in range(dp):
        g = r // share
        mine = physical[g * pp : g * pp + pp]
        sharing = min(share, dp - g * share)  # replicas on this group of devices
        cfg = one.replace(device="cuda", gpu_memory_share=1.0 / sharing)
        out.append(ReplicaPlacement(r, tuple(f"cuda:{d}" for d in mine), ",".join(mine), cfg))
    return out


def _under_torchrun() -> bool:
    env = os.environ
    return "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env


def _device_kind(device: str) -> str:
    """As every engine decides it (``deployment.resolve_device_kind``); imported here only,
    so that planning placements of a CPU run does not import torch before it must."""
    from ..loading.deployment import resolve_device_kind

    return resolve_device_kind(device)


def visible_gpus() -> list[str]:
    """This host's GPUs as CUDA_VISIBLE_DEVICES names them (the front end's own restriction
    is kept: replica devices are picked among those)."""
    import torch

    count = torch.cuda.device_count()  # counts devices without creating a context on one
    if count == 0:
        raise InvalidInputError(
            "device cuda was asked for but CUDA is not available", param="device"
        )
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed:
        names = [x.strip() for x in listed.split(",") if x.strip()]
        return names[:count]
    return [str(k) for k in range(count)]


def _cpu_shares(dp: int) -> list[int]:
    """Threads per replica: the cores this process may use, split as evenly as they go (at
    least one each)."""
    base, extra = divmod(usable_cpus(), dp)
    return [max(1, base + (1 if r < extra else 0)) for r in range(dp)]
