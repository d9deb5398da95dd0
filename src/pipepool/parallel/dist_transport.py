"""Point-to-point messages between pipeline ranks over torch.distributed backends.

Two process groups per engine, never the global default group (two engines in one process
must not collide):

- ``control`` (gloo, CPU): step plans driver -> stages, digests stage k -> k+1, results
  last stage -> driver. Pickled objects travel as a length message then a byte message.
- ``data`` (NCCL on GPU, gloo on CPU): hidden states stage k -> k+1.

Sends are non-blocking; a stage waits for its previous step's sends at the top of its next
send (so their buffers are never reused while in flight, and a slow successor applies back
pressure). Receives are posted early and waited lazily, right before first use.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from ..core.digest import Digest
from ..core.plan import StepPlan
from ..errors import StateDivergence

# Message tags on the control group (gloo matches a receive by source and tag).
TAG_PLAN_LEN, TAG_PLAN, TAG_DIGEST, TAG_RESULT_LEN, TAG_RESULT, TAG_HIDDEN = 1, 2, 3, 4, 5, 6
TAG_CLOCK, TAG_TRACE_LEN, TAG_TRACE = 7, 8, 9  # tracing: clock pings, then the spans


class P2PGroup(Protocol):
    """What the transport uses of a torch.distributed Backend (ProcessGroupGloo or
    ProcessGroupNCCL). torch's stub for Backend leaves out the point-to-point methods that
    both have."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work: ...


@dataclass
class Groups:
    """This stage process's place in the pipeline's process groups: gloo for control
    messages (plans, results, pings), the data group (NCCL on CUDA, else gloo) for activations."""

    rank: int
    world: int
    control: P2PGroup  # ProcessGroupGloo
    data: P2PGroup  # ProcessGroupNCCL or ProcessGroupGloo


def send_object(group, obj, dst: int, tags: tuple[int, int]) -> list:
    """Non-blocking send of a picklable object; returns the handles (and keeps buffers alive
    through them)."""
    payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    length = torch.tensor([len(payload)], dtype=torch.int64)
    body = torch.from_numpy(payload.copy())
    return [
        _Pending(group.send([length], dst, tags[0]), length),
        _Pending(group.send([body], dst, tags[1]), body),
    ]


def recv_object(group, src: int, tags: tuple[int, int]):
    """Blocking receive of an object sent with ``send_object``."""
    length = torch.empty(1, dtype=torch.int64)
    group.recv([length], src, tags[0]).wait()
    body = torch.empty(int(length.item()), dtype=torch.uint8)
    group.recv([body], src, tags[1]).wait()
    return pickle.loads(body.numpy().tobytes())


@dataclass
class _Pending:
    work: dist.Work
    buffer: torch.Tensor  # kept alive until the send completed

    def wait(self) -> None:
        self.work.wait()


def wait_all(pending: list[_Pending]) -> None:
    for p in pending:
        p.wait()
    pending.clear()


class DistOutbound:
    """Stage k's sends to stage k+1."""

    def __init__(self, groups: Groups, dst: int) -> None:
        self.groups, self.dst = groups, dst
        self._pending: list[_Pending] = []

    def send_hidden(self, hidden: torch.Tensor):
        """Send; returns the send's work handle, for a tracer to watch (waiting is ours)."""
        wait_all(self._pending)  # top of the step: last step's buffers are free again
        hidden = hidden.contiguous()
        work = self.groups.data.send([hidden], self.dst, TAG_HIDDEN)
        self._pending.append(_Pending(work, hidden))
        return work

    def send_digest(self, step_id: int, digest: Digest | None, busy: list[float]) -> None:
        """One int64 message: the digest chain of stages 0..k (zeros when state is not
        verified), then their busy clocks (telemetry, after the integrity data)."""
        stages = len(busy)
        if digest is None:
            wire = np.zeros(Digest.wire_size(stages), np.int64)
            wire[0] = step_id
        else:
            wire = digest.to_array()
        clocks = np.round(np.asarray(busy) * 1e6).astype(np.int64)
        buf = torch.from_numpy(np.concatenate([wire, clocks]))
        self._pending.append(_Pending(self.groups.control.send([buf], self.dst, TAG_DIGEST), buf))

    def flush(self) -> None:
        wait_all(self._pending)


class _DistIncoming:
    def __init__(
        self, groups: Groups, src: int, plan: StepPlan, hidden_shape, dtype, device, stage: int
    ):
        self._plan, self._stage = plan, stage
        self._hidden: torch.Tensor | None = None
        self._hidden_work: dist.Work | None = None
        if plan.num_reqs:
            self._hidden = torch.empty(hidden_shape, dtype=dtype, device=device)
            self._hidden_work = groups.data.recv([self._hidden], src, TAG_HIDDEN)
        self.receive_work = self._hidden_work  # for a tracer to watch; hidden() waits
        # [step_id, digest chain and parts of stages 0..stage-1, busy_us of each]
        self._wire = Digest.wire_size(stage)
        self._digest = torch.empty(self._wire + stage, dtype=torch.int64)
        self._digest_work = groups.control.recv([self._digest], src, TAG_DIGEST)
        self._digest_ready = False

    def hidden(self) -> torch.Tensor:
        if self._hidden_work is not None:
            self._hidden_work.wait()  # on NCCL: the compute stream waits, the host does not
            self._hidden_work = None
        assert self._hidden is not None, "a plan without requests carries no hidden states"
        return self._hidden

    def _digest_message(self) -> np.ndarray:
        if not self._digest_ready:
            self._digest_work.wait()
            self._digest_ready = True
            step_id = int(self._digest[0])
            if step_id != self._plan.step_id:
                raise StateDivergence(
                    step_id=self._plan.step_id,
                    stage=self._stage - 1,
                    request_id=-1,
                    expected=self._plan.step_id,
                    found=step_id,
                    what="step id of the previous stage",
                )
        return self._digest.numpy()

    def digest(self) -> Digest:
        return Digest.from_array(self._digest_message()[: self._wire], self._stage)

    def stage_busy_s(self) -> list[float]:
        busy = self._digest_message()[self._wire :]
        return (busy / 1e6).tolist()


class DistInbound:
    """Stage k's receives from stage k-1; shapes come from the plan (``rows(plan)``: the rows
    stage k-1 sends, ``StageModel.received_rows``)."""

    def __init__(
        self, groups: Groups, src: int, hidden_size: int, dtype, device, stage: int,
        rows: Callable[[StepPlan], int],
    ) -> None:  # fmt: skip
        self.groups, self.src, self.rows = groups, src, rows
        self.hidden_size, self.dtype, self.device, self.stage = hidden_size, dtype, device, stage

    def post(self, plan: StepPlan) -> _DistIncoming:
        return _DistIncoming(
            self.groups,
            self.src,
            plan,
            (self.rows(plan), self.hidden_size),
            self.dtype,
            self.device,
            self.stage,
        )
