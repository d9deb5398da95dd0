"""Several models on one host: how its memory is shared between them, decided before any starts.

One model alone takes what its GPUs have free when it loads (``deployment._gpu_kv_tokens``).
Several cannot: the first to load would take the KV cache of all. So the plan reads each
model's needs from its checkpoint's index (``deployment.memory_needs``: weights, a step's
working set, each process's overhead, the KV cache's bytes a token and the least KV it runs
with), places every stage of every replica where the model's own placement puts it
(``replicas.placement``), and gives each causal model what is left of its devices in equal
shares, as a fixed ``kv_cache_tokens``. A plan that does not fit is refused with the numbers,
before any model starts: never an out-of-memory error on the first large request.

On the CPU the same plan is made in host memory (``MemAvailable``); the KV cache there is
address space touched as it is used (``stage/kv_cache.py``), so the plan counts the least
each model runs with and leaves the reservation as it is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..config import EngineConfig
from ..errors import InvalidInputError
from ..loading.deployment import (
    GPU_MEMORY_UTILIZATION,
    ModelMemory,
    memory_needs,
    resolve_device_kind,
)
from .placement import plan_placement, visible_gpus

_GIB = float(1 << 30)


@dataclass(frozen=True)
class PlannedModel:
    """One model in the plan: its config as planned (on GPU a causal model's
    ``kv_cache_tokens`` fixed), its needs, the device of each of its stages (every replica's),
    and the KV tokens the plan counts for each stage (0: no KV cache; on CPU the least it runs
    with)."""

    name: str
    config: EngineConfig
    memory: ModelMemory
    devices: tuple[str, ...]
    kv_tokens: int

    def bytes_on(self, device: str) -> int:
        """What the plan counts for this model on ``device``."""
        stages = self.devices.count(device)
        return stages * (self.memory.fixed + self.kv_tokens * self.memory.kv_bytes_per_token)


@dataclass(frozen=True)
class MemoryPlan:
    """Every model's share of the host's devices (``capacity``: the bytes the plan may use on
    each, by device name), in the order the models were given."""

    device_kind: str
    capacity: Mapping[str, int]
    models: tuple[PlannedModel, ...]

    def used(self, device: str) -> int:
        """Bytes the plan counts on ``device``, all models together."""
        return sum(m.bytes_on(device) for m in self.models)

    def describe(self) -> str:
        """The plan as the server prints it at start: a row per model and device, in GiB."""
        kv_note = "KV (tokens)" if self.device_kind == "cuda" else "least KV (tokens)"
        header = f"{'model':<24} {'device':<8} {'weights':>8} {'step':>8} {'process':>8} "
        lines = ["memory plan (GiB):", "  " + header + f"{kv_note:>22} {'total':>8}"]
        for m in self.models:
            mem = m.memory
            kv = m.kv_tokens
            for device in dict.fromkeys(m.devices):
                n = m.devices.count(device)
                each = "" if n == 1 else f" x{n}"
                kv_text = "-" if not mem.kv_bytes_per_token else (
                    f"{kv * mem.kv_bytes_per_token / _GIB:.2f} ({kv:,})"
                )  # fmt: skip
                lines.append(
                    f"  {m.name[:24]:<24} {device + each:<8} {mem.weights / _GIB:>8.2f} "
                    f"{mem.activations / _GIB:>8.2f} {mem.overhead / _GIB:>8.2f} "
                    f"{kv_text:>22} {m.bytes_on(device) / _GIB:>8.2f}"
                )
        if self.device_kind == "cuda":
            basis = f"free memory x {GPU_MEMORY_UTILIZATION}"
        else:
            basis = "MemAvailable"
        for device, cap in self.capacity.items():
            used = self.used(device)
            if used:
                lines.append(
                    f"  {device}: {used / _GIB:.2f} of {cap / _GIB:.2f} GiB planned ({basis})"
                )
        return "\n".join(lines)


class MemoryPlanError(InvalidInputError):
    """The models do not fit the host's memory; the message gives the plan's numbers."""


def plan_memory(
    configs: Sequence[tuple[str, EngineConfig]], capacity: Mapping[str, int] | None = None
) -> MemoryPlan:
    """The plan of ``configs`` (name, config) on this host; ``capacity``: the bytes usable on
    each device (default: measured now, GPUs by a short-lived process so that this one holds
    no CUDA context). Raises ``MemoryPlanError`` when they cannot all fit."""
    kinds = {resolve_device_kind(c.device) for _, c in configs}
    if len(kinds) != 1:
        raise InvalidInputError(
            "the models of one server run on one kind of device: "
            + ", ".join(f"{n} on {resolve_device_kind(c.device)}" for n, c in configs),
            param="device",
        )
    (kind,) = kinds
    placed = []
    for name, config in configs:
        try:
            memory = memory_needs(config, kind)
            stages = tuple(d for p in plan_placement(config) for d in p.devices)
        except Exception as exc:
            exc.add_note(f"model {name!r} ({config.model}): read for the memory plan")
            raise
        placed.append((name, config, memory, stages))
    if capacity is None:
        capacity = _gpu_capacity() if kind == "cuda" else {"cpu": _host_available()}
    plan = share_memory(kind, capacity, placed)
    for device, cap in capacity.items():
        if plan.used(device) > cap:
            raise MemoryPlanError(
                f"the models do not fit {device}: they need {plan.used(device) / _GIB:.2f} GiB "
                f"of {cap / _GIB:.2f} GiB usable\n{plan.describe()}",
                param="model",
            )
    return plan


def share_memory(kind: str, capacity: Mapping[str, int], placed) -> MemoryPlan:
    """Each causal model's KV tokens on GPU: the least it needs plus an equal share of what
    is left on its devices (fewest over its stages); on CPU the least it needs."""
    unknown = {d for *_, stages in placed for d in stages} - set(capacity)
    if unknown:
        raise InvalidInputError(
            f"no memory figure for {', '.join(sorted(unknown))}", param="device"
        )
    models = [
        PlannedModel(name, config, memory, stages, _least(memory))
        for name, config, memory, stages in placed
    ]
    if kind != "cuda":
        return MemoryPlan(kind, dict(capacity), tuple(models))
    # Bytes left on each device once every stage has its fixed needs and least KV.
    left = {d: cap - sum(m.bytes_on(d) for m in models) for d, cap in capacity.items()}
    growing = {d: 0 for d in capacity}  # stages whose KV takes a share of what is left
    for m in models:
        if m.memory.kv_bytes_per_token and m.memory.kv_cache_tokens is None:
            for d in m.devices:
                growing[d] += 1
    out = []
    for m in models:
        mem = m.memory
        tokens = m.kv_tokens
        if mem.kv_bytes_per_token and mem.kv_cache_tokens is None:
            extra = min(max(0, left[d]) // growing[d] for d in m.devices)
            tokens = mem.min_kv_tokens + extra // mem.kv_bytes_per_token
        config = m.config.replace(kv_cache_tokens=tokens) if mem.kv_bytes_per_token else m.config
        out.append(PlannedModel(m.name, config, mem, m.devices, tokens))
    return MemoryPlan(kind, dict(capacity), tuple(out))


def _least(memory: ModelMemory) -> int:
    if not memory.kv_bytes_per_token:
        return 0
    if memory.kv_cache_tokens is not None:
        return memory.kv_cache_tokens
    return memory.min_kv_tokens


_FREE_MEMORY = (
    "import json, torch\n"
    "print(json.dumps([torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]))"
)


def _gpu_capacity() -> dict[str, int]:
    """Usable bytes of each visible GPU (its free memory x ``GPU_MEMORY_UTILIZATION``), by the
    name placements give it, measured in a process of its own: a CUDA context made here would
    stay for the server's life and count against every model."""
    done = subprocess.run(
        [sys.executable, "-c", _FREE_MEMORY], capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        raise InvalidInputError(
            f"could not measure the GPUs' free memory: {done.stderr.strip()[-500:]}",
            param="device",
        )
    free = json.loads(done.stdout.strip().splitlines()[-1])
    names = visible_gpus()
    return {f"cuda:{n}": int(b * GPU_MEMORY_UTILIZATION) for n, b in zip(names, free, strict=True)}


def _host_available() -> int:
    """The host's available memory (``MemAvailable``), else its physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
