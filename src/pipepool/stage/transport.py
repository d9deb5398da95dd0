"""What travels between neighbouring stages (hidden states, digest). In-process links live
here; the ``torch.distributed`` ones in ``parallel/dist_transport.py``."""

from __future__ import annotations

from collections import deque
from typing import Protocol

import torch

from ..core.digest import Digest
from ..core.plan import StepPlan


class Incoming(Protocol):
    """One step's inputs from the previous stage; each accessor waits only when first used."""

    def hidden(self) -> torch.Tensor: ...  # [T, hidden]

    def digest(self) -> Digest: ...  # the state digest chain of stages 0..k-1

    def stage_busy_s(self) -> list[float]: ...  # cumulative busy seconds of stages 0..k-1


class Inbound(Protocol):
    """Where a stage receives its inputs for each plan: the previous stage's hidden states
    and digest (``post(plan)`` returns them as an ``Incoming`` to wait on lazily)."""

    def post(self, plan: StepPlan) -> Incoming: ...


class Outbound(Protocol):
    """Where a non-last stage sends its hidden states and digest for the next stage."""

    # Returns the transfer's work handle where there is one (torch.distributed), else None.
    def send_hidden(self, hidden: torch.Tensor) -> object | None: ...

    def send_digest(self, step_id: int, digest: Digest | None, busy: list[float]) -> None: ...


class _LocalIncoming:
    def __init__(self, link: LocalLink) -> None:
        self._link = link
        self._digest: tuple[Digest | None, list[float]] | None = None

    def hidden(self) -> torch.Tensor:
        return self._link.hidden.popleft()

    def digest(self) -> Digest:
        digest = self._message()[0]
        # Only read when state is verified, and then every stage sends its digest.
        assert digest is not None, "the previous stage sent no digest"
        return digest

    def stage_busy_s(self) -> list[float]:
        return self._message()[1]

    def _message(self) -> tuple[Digest | None, list[float]]:
        if self._digest is None:
            self._digest = self._link.digests.popleft()
        return self._digest


class LocalLink:
    """A stage boundary inside one process (PP simulated in-process, for tests and tools).
    ``device``: the receiving stage's; hidden states on another device are copied there."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.hidden: deque[torch.Tensor] = deque()
        self.digests: deque[tuple[Digest | None, list[float]]] = deque()

    def post(self, plan: StepPlan) -> Incoming:
        return _LocalIncoming(self)

    def send_hidden(self, hidden: torch.Tensor) -> None:
        if self.device is not None and hidden.device != self.device:
            # A blocking copy: ordered after the producing stream, before the consumer's use.
            hidden = hidden.to(self.device)
        self.hidden.append(hidden)

    def send_digest(self, step_id: int, digest: Digest | None, busy: list[float]) -> None:
        self.digests.append((digest, list(busy)))
