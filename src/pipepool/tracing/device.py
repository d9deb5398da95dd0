"""Spans on a stage's device timeline.

On CUDA a span is a pair of events on the compute stream, so it measures what the device did
(a receive the stream waits for shows as a wait, however early the host queued it), not when
the host queued it. Events are read once the device passed them, never blocking the host, and
mapped to the host clock through two anchors (one when tracing starts, one when the spans are
gathered), which also corrects the drift between the GPU's timer and the host's clock.
On CPU the device is the host: a span is two host clock reads.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from .recorder import MAX_SPANS, Recorder, Span, now

if TYPE_CHECKING:
    import torch


class HostClock:
    """CPU stages: the device clock is the host clock. Transfers (gloo) run on threads of
    their own; the stage's waits for them are its spans."""

    watches_transfers = False

    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder

    def begin(self):
        return now()

    def end(self, start, name: str, step: int, tokens: int, reqs: int) -> None:
        self._recorder.span("device", name, start, now(), step, tokens, reqs)

    def export(self) -> list[Span]:
        return []


class CudaClock:
    """CUDA stages: event pairs on the current stream of ``device``.

    NCCL sends and receives run on NCCL's own stream, beside the compute: ``transfer`` spans
    them from the compute stream's position when they were queued (NCCL starts no earlier)
    to their completion, seen by an event on a side stream that waits for them and does
    nothing else. A send that spins for long beside the compute shows there."""

    watches_transfers = True

    def __init__(self, device) -> None:
        import torch

        self._torch, self._device = torch, device
        self._free: list = []  # events whose time was read, ready for reuse
        # (track, name, start event, end event, step, tokens, reqs), in the order recorded
        self._pending: deque = deque()
        self._done: deque = deque(maxlen=MAX_SPANS)  # the same with times in ms from the anchor
        # (event, host ns): made on first use, once the device is set
        self._anchor: tuple[torch.cuda.Event, int] | None = None
        self._side = None  # the stream that waits for transfers (made on first use)

    def begin(self):
        if self._anchor is None:
            self._anchor = self._make_anchor()
        return self._record()

    def end(self, start, name: str, step: int, tokens: int, reqs: int) -> None:
        self._pending.append(("device", name, start, self._record(), step, tokens, reqs))
        self._poll()

    def transfer(self, start, name: str, work, step: int, tokens: int, reqs: int) -> None:
        """``work`` (a torch.distributed handle) ends the span ``start`` began."""
        torch = self._torch
        if self._side is None:
            self._side = torch.cuda.Stream(self._device)
        with torch.cuda.stream(self._side):
            work.wait()  # on NCCL: this stream waits for the transfer, the host does not
            end = self._record()
        self._pending.append(("transfer", name, start, end, step, tokens, reqs))

    def export(self) -> list[Span]:
        """Every span so far on the host clock (waits for the device to finish its work)."""
        if self._anchor is None:
            return []
        self._torch.cuda.synchronize(self._device)
        self._poll()
        (ev0, ns0), (ev1, ns1) = self._anchor, self._make_anchor()
        device_ms = ev0.elapsed_time(ev1)
        # ns of host time per ms of device time; a timer that drifted by more than 0.1%
        # means something else is wrong: trust the device's own scale then.
        scale = (ns1 - ns0) / device_ms if device_ms > 0 else 1e6
        if abs(scale / 1e6 - 1) > 1e-3:
            scale = 1e6
        return [
            Span(track, name, ns0 + round(a * scale), ns0 + round(b * scale), step, tok, req)
            for track, name, a, b, step, tok, req in self._done
        ]

    def _record(self):
        """An event on the current stream (the side stream inside ``transfer``)."""
        torch = self._torch
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device))
        return event

    def _poll(self) -> None:
        """Read the spans the device has finished (in the order recorded) and recycle their
        events."""
        # Spans are only recorded after ``begin`` made the anchor.
        assert self._anchor is not None, "no anchor before the first span"
        anchor = self._anchor[0]
        pending = self._pending
        while pending and pending[0][3].query():
            track, name, e0, e1, step, tokens, reqs = pending.popleft()
            a, b = anchor.elapsed_time(e0), anchor.elapsed_time(e1)
            self._done.append((track, name, a, b, step, tokens, reqs))
            self._free += (e0, e1)

    def _make_anchor(self):
        """An event and the host time at which the device passed it: the middle of the
        shortest of a few record-then-wait rounds on an idle stream (error: half of it)."""
        torch = self._torch
        stream = torch.cuda.current_stream(self._device)
        stream.synchronize()
        best = None
        for _ in range(5):
            event = torch.cuda.Event(enable_timing=True)
            t0 = now()
            event.record(stream)
            event.synchronize()
            t1 = now()
            if best is None or t1 - t0 < best[2]:
                best = (event, (t0 + t1) // 2, t1 - t0)
        return best[0], best[1]


def device_clock(device, recorder: Recorder) -> HostClock | CudaClock:
    return CudaClock(device) if device.type == "cuda" else HostClock(recorder)
