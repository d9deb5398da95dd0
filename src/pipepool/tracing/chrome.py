"""Chrome trace-event JSON (the format of chrome://tracing, opened by ui.perfetto.dev).

One process per pipeline process (the driver, each stage), one thread per track in it
(the stage's host, its device; the driver's loop and its in-flight periods); every span is a
complete event ("X") named after what happened, with the step, its tokens and its requests as
arguments. Times are microseconds from the first span, on the driver's clock; the file's
``otherData.origin_ns`` says when that was (``time.monotonic_ns()`` of the driver process).
"""

from __future__ import annotations

import json
from pathlib import Path

from .recorder import ProcessTrace
from .summary import BUSY, WAIT_INPUT, WAIT_SEND

# Events kept in one file: ~110 bytes each, so about 13 MB at most; the newest are kept.
MAX_EVENTS = 120_000
_TRACKS = {"loop": 1, "pipeline": 2, "host": 1, "device": 2, "transfer": 3}
_TRACK_NAMES = {
    "loop": "engine loop",
    "pipeline": "plans in flight",
    "host": "host",
    "device": "device",
    "transfer": "transfers (NCCL stream)",
}


def _category(name: str) -> str:
    if name in BUSY:
        return "busy"
    if name in WAIT_INPUT:
        return "wait_input"
    if name in WAIT_SEND:
        return "wait_send"
    if name.startswith("nccl "):
        return "transfer"
    return "host"


def chrome_events(
    traces: list[ProcessTrace], since_ns: int | None = None, until_ns: int | None = None
) -> list[dict]:
    """The trace events of every span overlapping [since, until], newest ``MAX_EVENTS``."""
    return _chrome_events(traces, since_ns, until_ns)[0]


def _chrome_events(
    traces: list[ProcessTrace], since_ns: int | None, until_ns: int | None
) -> tuple[list[dict], int]:
    """(the events, the driver's clock at their time zero)."""
    lo = since_ns if since_ns is not None else -(2**63)
    hi = until_ns if until_ns is not None else 2**63
    rows = []  # (start on the driver's clock, pid, span)
    for pid, trace in enumerate(sorted(traces, key=lambda t: t.sort)):
        for s in trace.spans:
            a, b = s.start_ns + trace.offset_ns, s.end_ns + trace.offset_ns
            if b >= lo and a <= hi:
                rows.append((a, b, pid, s))
    rows.sort(key=lambda r: r[0])
    rows = rows[-MAX_EVENTS:]
    base = rows[0][0] if rows else 0
    events: list[dict] = []
    for pid, trace in enumerate(sorted(traces, key=lambda t: t.sort)):
        events.append(_meta("process_name", pid, 0, {"name": trace.name}))
        events.append(_meta("process_sort_index", pid, 0, {"sort_index": trace.sort}))
        for track in sorted({s.track for s in trace.spans}):
            tid = _TRACKS.get(track, 9)
            events.append(_meta("thread_name", pid, tid, {"name": _TRACK_NAMES.get(track, track)}))
            events.append(_meta("thread_sort_index", pid, tid, {"sort_index": tid}))
    for a, b, pid, s in rows:
        event = {
            "name": s.name,
            "cat": _category(s.name),
            "ph": "X",
            "ts": round((a - base) / 1e3, 3),
            "dur": round((b - a) / 1e3, 3),
            "pid": pid,
            "tid": _TRACKS.get(s.track, 9),
        }
        if s.step >= 0:
            event["args"] = {"step": s.step, "tokens": s.tokens, "requests": s.reqs}
        events.append(event)
    return events, base


def _meta(name: str, pid: int, tid: int, args: dict) -> dict:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def write_chrome_trace(
    path: str | Path,
    traces: list[ProcessTrace],
    since_ns: int | None = None,
    until_ns: int | None = None,
) -> None:
    events, origin_ns = _chrome_events(traces, since_ns, until_ns)
    document = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"origin_ns": origin_ns},
    }
    text = json.dumps(document, separators=(",", ":"))
    Path(path).write_text(text)
