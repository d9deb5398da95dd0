"""Gathering stage processes' trace spans over the control group (tracing on only).

The driver sends a stage the trace plan (in plan order, so the stage has applied every
earlier plan), pings it ``PING_ROUNDS`` times to align clocks, then receives its spans.
"""

from __future__ import annotations

import torch

from ..core.plan import trace_plan
from ..tracing.clock import PING_ROUNDS, offset_for
from ..tracing.recorder import ProcessTrace, host_id, now
from .dist_transport import (
    TAG_CLOCK,
    TAG_PLAN,
    TAG_PLAN_LEN,
    TAG_TRACE,
    TAG_TRACE_LEN,
    recv_object,
    send_object,
    wait_all,
)


def gather_stage_trace(control, rank: int) -> ProcessTrace:
    """Driver side: rank's spans, their times moved onto this process's clock."""
    sends = send_object(control, trace_plan(), rank, (TAG_PLAN_LEN, TAG_PLAN))
    samples = []
    ping, pong = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    for _ in range(PING_ROUNDS):
        sent = now()
        control.send([ping], rank, TAG_CLOCK).wait()
        control.recv([pong], rank, TAG_CLOCK).wait()
        samples.append((sent, int(pong.item()), now()))
    trace = recv_object(control, rank, (TAG_TRACE_LEN, TAG_TRACE))
    wait_all(sends)
    return trace.aligned(offset_for(host_id(), trace.host_id, samples))


def answer_trace(control, trace: ProcessTrace | None, name: str) -> None:
    """Stage side, on the trace plan: answer the pings, then send the spans."""
    ping = torch.zeros(1, dtype=torch.int64)
    for _ in range(PING_ROUNDS):
        control.recv([ping], 0, TAG_CLOCK).wait()
        control.send([torch.tensor([now()], dtype=torch.int64)], 0, TAG_CLOCK).wait()
    if trace is None:  # tracing was not on when this stage started
        trace = ProcessTrace(name, 0, host_id())
    wait_all(send_object(control, trace, 0, (TAG_TRACE_LEN, TAG_TRACE)))
