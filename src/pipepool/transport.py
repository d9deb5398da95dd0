"""What travels between neighbouring stages (hidden states, digest) and from the last stage
back to the driver (pooled outputs, digest). In-process links live here; the
``torch.distributed`` ones in ``parallel/dist_transport.py``."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from .plan import StepPlan, StepResult


class Incoming(Protocol):
    """One step's inputs from the previous stage; each accessor waits only when first used."""

    def hidden(self) -> torch.Tensor: ...  # [T, hidden]

    def digest(self) -> np.ndarray: ...  # [R] previous stage's post-step num_computed_tokens

    def stage_busy_s(self) -> list[float]: ...  # cumulative busy seconds of stages 0..k-1


class Inbound(Protocol):
    def post(self, plan: StepPlan) -> Incoming: ...


class Outbound(Protocol):
    def send_hidden(self, hidden: torch.Tensor) -> None: ...

    def send_digest(self, step_id: int, digest: np.ndarray, busy: list[float]) -> None: ...


@dataclass
class StageOutput:
    """What the last stage produced for one plan, still on its device."""

    vec_ids: list[int]
    vectors: torch.Tensor | None  # [n, D] fp32: finished LAST/MEAN/CLS requests
    all_ids: list[int]
    all_out: list[torch.Tensor]  # [len, H] per finished ALL request
    step_id: int = -1
    digest: np.ndarray | None = None
    stage_busy_s: tuple[float, ...] = ()
    _host: list | None = field(default=None, repr=False)
    _event: object | None = field(default=None, repr=False)

    def start_host_copy(self) -> None:
        """Queue the device->host copies without waiting (overlaps the next step's work)."""
        tensors = ([self.vectors] if self.vectors is not None else []) + list(self.all_out)
        if not tensors:
            self._host = []
            return
        device = tensors[0].device
        if device.type != "cuda":
            self._host = [t.float() for t in tensors]
            return
        host = []
        for t in tensors:
            buf = torch.empty(t.shape, dtype=torch.float32, pin_memory=True)
            buf.copy_(t, non_blocking=True)
            host.append(buf)
        self._event = torch.cuda.Event()
        self._event.record()
        self._host = host

    def to_result(self) -> StepResult:
        if self._host is None:
            self.start_host_copy()
        if self._event is not None:
            self._event.synchronize()
        host = [t.numpy() for t in self._host]
        outputs: dict[int, np.ndarray] = {}
        if self.vectors is not None:
            vectors = host.pop(0)
            outputs.update(zip(self.vec_ids, vectors, strict=True))
        outputs.update(zip(self.all_ids, host, strict=True))
        return StepResult(self.step_id, self.digest, outputs, self.stage_busy_s)


class _LocalIncoming:
    def __init__(self, link: LocalLink) -> None:
        self._link = link
        self._digest = None

    def hidden(self) -> torch.Tensor:
        return self._link.hidden.popleft()

    def digest(self) -> np.ndarray:
        return self._message()[0]

    def stage_busy_s(self) -> list[float]:
        return self._message()[1]

    def _message(self) -> tuple[np.ndarray, list[float]]:
        if self._digest is None:
            self._digest = self._link.digests.popleft()
        return self._digest


class LocalLink:
    """A stage boundary inside one process (PP simulated in-process, for tests and tools)."""

    def __init__(self) -> None:
        self.hidden: deque[torch.Tensor] = deque()
        self.digests: deque[tuple[np.ndarray, list[float]]] = deque()

    def post(self, plan: StepPlan) -> Incoming:
        return _LocalIncoming(self)

    def send_hidden(self, hidden: torch.Tensor) -> None:
        self.hidden.append(hidden)

    def send_digest(self, step_id: int, digest: np.ndarray, busy: list[float]) -> None:
        self.digests.append((digest, list(busy)))
