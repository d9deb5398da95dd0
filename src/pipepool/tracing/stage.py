"""What a stage records of each step: host phases one after the other on its "host" track,
and device spans (compute, pooling, waits for input and for sends) on its "device" track.

The runner holds a ``StageTrace`` or None, and marks phase boundaries; the transport is
wrapped (``traced``) so that waits are recorded where they happen.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from .device import CudaClock, device_clock
from .recorder import ProcessTrace, Recorder, now

if TYPE_CHECKING:
    import torch

    from ..core.plan import StepPlan


class StageTrace:
    """One stage's recorder. Its step labels (step id, tokens, requests) are the plan's being
    applied, and go on every span until the next plan."""

    def __init__(self, index: int, device: torch.device) -> None:
        self.recorder = Recorder(f"stage {index}", sort=index + 1)
        self.clock = device_clock(device, self.recorder)
        self._phase: str | None = None
        self._since = 0
        self.step, self.tokens, self.reqs = -1, 0, 0

    # -- host phases -------------------------------------------------------------------------

    def begin_step(self, plan: StepPlan, phase: str = "prepare") -> None:
        self.step, self.tokens, self.reqs = plan.step_id, plan.num_tokens, plan.num_reqs
        self._phase, self._since = phase, now()

    def phase(self, name: str | None) -> None:
        """Close the current host phase and open ``name`` (None: the step's host work ends)."""
        t = now()
        if self._phase is not None:
            self.host(self._phase, self._since, t)
        self._phase, self._since = name, t

    def waited_plan(self, start_ns: int, plan: StepPlan) -> None:
        """A stage process waited from ``start_ns`` for ``plan`` to arrive."""
        self.step, self.tokens, self.reqs = plan.step_id, plan.num_tokens, plan.num_reqs
        self.host("wait plan", start_ns)

    def host(self, name: str, start_ns: int, end_ns: int | None = None) -> None:
        end = now() if end_ns is None else end_ns
        self.recorder.span("host", name, start_ns, end, self.step, self.tokens, self.reqs)

    # -- device spans ------------------------------------------------------------------------

    def begin_device(self):
        return self.clock.begin()

    def end_device(self, mark, name: str) -> None:
        self.clock.end(mark, name, self.step, self.tokens, self.reqs)

    def watch_transfer(self, name: str, work: object | None) -> None:
        """On CUDA, a span of the transfer ``work`` on the stage's "transfer" track, from the
        compute stream's position now; a no-op on the CPU, or for links without handles."""
        clock = self.clock
        # Only a CUDA clock watches transfers (a host clock's waits are its own spans).
        if work is None or not isinstance(clock, CudaClock) or not clock.watches_transfers:
            return
        try:
            clock.transfer(clock.begin(), name, work, self.step, self.tokens, self.reqs)
        except Exception as exc:  # a timeline must never take the pipeline down
            clock.watches_transfers = False
            warnings.warn(f"not tracing NCCL transfers any more: {exc!r}", stacklevel=2)

    def export(self) -> ProcessTrace:
        return self.recorder.export(self.clock.export())


class _TracedIncoming:
    """The previous stage's inputs; records how long each first use waits."""

    def __init__(self, incoming, trace: StageTrace) -> None:
        self._incoming, self._trace = incoming, trace
        self._digest_waited = False

    def hidden(self):
        mark = self._trace.begin_device()
        hidden = self._incoming.hidden()
        self._trace.end_device(mark, "wait input")
        return hidden

    def digest(self):
        return self._message(self._incoming.digest)

    def stage_busy_s(self):
        return self._message(self._incoming.stage_busy_s)

    def _message(self, read):
        if self._digest_waited:
            return read()
        t = now()
        value = read()
        self._trace.host("wait digest", t)
        self._digest_waited = True
        return value


class _TracedInbound:
    def __init__(self, inbound, trace: StageTrace) -> None:
        self._inbound, self._trace = inbound, trace

    def post(self, plan):
        incoming = self._inbound.post(plan)
        self._trace.watch_transfer("nccl receive", getattr(incoming, "receive_work", None))
        return _TracedIncoming(incoming, self._trace)


class _TracedOutbound:
    """Sends to the next stage; ``send_hidden`` first waits until the previous step's sends
    completed (back pressure from a slower successor): that wait is the "wait send" span."""

    def __init__(self, outbound, trace: StageTrace) -> None:
        self._outbound, self._trace = outbound, trace

    def send_hidden(self, hidden) -> None:
        mark = self._trace.begin_device()
        work = self._outbound.send_hidden(hidden)
        self._trace.end_device(mark, "wait send")
        self._trace.watch_transfer("nccl send", work)

    def send_digest(self, step_id, digest, busy) -> None:
        self._outbound.send_digest(step_id, digest, busy)


def traced(trace: StageTrace, inbound, outbound):
    """The stage's links, recording their waits."""
    return (
        None if inbound is None else _TracedInbound(inbound, trace),
        None if outbound is None else _TracedOutbound(outbound, trace),
    )
