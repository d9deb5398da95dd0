"""The step timeline (issue 12): a Chrome trace with one track per process and the expected
spans of every step, clocks aligned across processes, and a summary whose fractions add up."""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest

from pipepool import Engine, InvalidInputError
from pipepool.commands.cli import main
from pipepool.tracing import ProcessTrace, Span, summarize
from pipepool.tracing.chrome import chrome_events, write_chrome_trace
from pipepool.tracing.clock import estimate_offset, offset_for
from pipepool.tracing.intervals import intersect, length, subtract, union

STAGE0 = {"prepare", "compute", "forward", "send", "wait send", "post-step"}
LAST = {"wait plan", "receive", "wait input", "compute", "forward", "pool", "post-step",
        "wait digest", "result"}  # fmt: skip
DRIVER = {"schedule", "submit", "wait result", "deliver"}


def _prompts(n: int = 12, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 200, size=k).tolist() for k in rng.integers(3, 90, size=n)]


def _load(path) -> tuple[dict[int, str], dict[tuple[int, int], str], list[dict]]:
    events = json.loads(path.read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e["name"] == "thread_name"}  # fmt: skip
    spans = [e for e in events if e["ph"] == "X"]
    return processes, threads, spans


@pytest.fixture(scope="module")
def pp2_trace(qwen3_path, tmp_path_factory):
    """A real two-process pipeline over gloo, budget 32 so that prompts are chunked."""
    path = tmp_path_factory.mktemp("trace") / "pp2.json"
    with Engine(
        str(qwen3_path), pipeline_parallel_size=2, max_num_batched_tokens=32, trace=str(path)
    ) as engine:
        engine.embed(_prompts())
        steps = engine.stats.steps
        summary = engine.write_trace()
    return path, steps, summary


def test_pp2_trace_has_a_track_per_process_and_every_steps_spans(pp2_trace):
    path, steps, _ = pp2_trace
    processes, threads, spans = _load(path)
    assert sorted(processes.values()) == ["driver", "stage 0", "stage 1"]
    pid = {name: p for p, name in processes.items()}
    for stage in ("stage 0", "stage 1"):
        assert {threads[(pid[stage], t)] for t in (1, 2)} == {"host", "device"}
    names = defaultdict(lambda: defaultdict(set))  # process -> step -> span names
    for e in spans:
        assert e["dur"] >= 0
        if "args" in e:
            names[processes[e["pid"]]][e["args"]["step"]].add(e["name"])
    assert len(names["driver"]) == steps
    for step in names["driver"]:
        assert names["driver"][step] >= DRIVER
        assert names["stage 0"][step] >= STAGE0
        assert names["stage 1"][step] >= LAST
    # Every span of a step carries the same labels as the driver's plan.
    plans = {e["args"]["step"]: e["args"] for e in spans if e["name"] == "schedule"}
    assert all(e["args"] == plans[e["args"]["step"]] for e in spans
               if "args" in e and e["args"]["step"] in plans)  # fmt: skip
    assert sum(a["tokens"] for a in plans.values()) == sum(len(p) for p in _prompts())


def test_pp2_trace_clocks_respect_causality_across_processes(pp2_trace):
    path, _, _ = pp2_trace
    processes, _, spans = _load(path)
    by = {(processes[e["pid"]], e["name"], e["args"]["step"]): e for e in spans if "args" in e}
    for (process, name, step), e in by.items():
        if process != "stage 1" or name != "wait input":
            continue
        send = by[("stage 0", "wait send", step)]
        assert e["ts"] + e["dur"] >= send["ts"]  # received only after the send began
        # stage 1 computes a step only after stage 0 computed it
        first, second = by[("stage 0", "forward", step)], by[("stage 1", "forward", step)]
        assert second["ts"] >= first["ts"] + first["dur"]
        # and the driver gets its result only after the last stage pooled it
        pooled, result = by[("stage 1", "pool", step)], by[("driver", "wait result", step)]
        assert result["ts"] + result["dur"] >= pooled["ts"] + pooled["dur"]


def test_pp2_summary_fractions_add_up(pp2_trace):
    _, steps, summary = pp2_trace
    assert [s.stage for s in summary.stages] == ["stage 0", "stage 1"]
    for s in summary.stages:
        parts = (s.busy, s.wait_input, s.wait_send, s.host, s.fill, s.drain)
        assert all(p >= 0 for p in parts)
        assert sum(parts) == pytest.approx(1.0, abs=1e-9)
        assert s.steps == steps and s.busy > 0
    # Stage 0 waits for input only while the driver holds its next plan back for a result.
    assert 0 < summary.stages[0].wait_input <= summary.driver["wait result"]
    row = summary.as_dict()
    assert row["stages"][1]["bubble"] == pytest.approx(summary.stages[1].bubble, abs=1e-4)
    assert "busy" in summary.text() and "bubble" in summary.text()


def test_inproc_trace_is_written_on_close(qwen3_path, tmp_path):
    path = tmp_path / "t.json"
    engine = Engine(str(qwen3_path), pipeline_parallel_size=2, pipeline_backend="inproc",
                    max_num_batched_tokens=32, trace=str(path))  # fmt: skip
    engine.embed(_prompts(4))
    engine.close()
    processes, _, spans = _load(path)
    assert sorted(processes.values()) == ["driver", "stage 0", "stage 1"]
    assert {e["name"] for e in spans} >= STAGE0 | DRIVER | {"pool", "wait input"}


def test_tracing_off_records_nothing(qwen3_path):
    with Engine(str(qwen3_path)) as engine:
        engine.embed(_prompts(2))
        assert engine.pipeline._trace is None
        assert all(r.trace is None for r in engine.pipeline.runners)
        with pytest.raises(InvalidInputError, match="tracing is off"):
            engine.write_trace()


def test_embed_trace_flag_writes_the_file_and_prints_the_summary(bert_path, tmp_path, capsys):
    path = tmp_path / "embed.json"
    code = main(["embed", "--model", str(bert_path), "--no-progress", "--trace", str(path),
                 "hello", "world"])  # fmt: skip
    assert code == 0
    assert "pipeline timeline: 1 stage(s)" in capsys.readouterr().err
    processes, _, spans = _load(path)
    assert sorted(processes.values()) == ["driver", "stage 0"]
    assert {"forward", "pool", "schedule"} <= {e["name"] for e in spans}


# -- the pieces, with figures derived by hand ---------------------------------------------------


def test_interval_algebra():
    a = union([(5, 7), (0, 2), (1, 3), (9, 9)])
    assert a == [(0, 3), (5, 7)]
    assert intersect(a, [(2, 6)]) == [(2, 3), (5, 6)]
    assert subtract([(0, 10)], [(1, 2), (4, 6), (9, 12)]) == [(0, 1), (2, 4), (6, 9)]
    assert length(a) == 5


def _span(track, name, a, b, step=0):
    return Span(track, name, a, b, step, 8, 1)


def test_summary_by_hand():
    """One period 0..100: the stage computes 10..40 and 60..80, waits for input 40..55 (and
    during its compute, which counts as busy), waits to send 80..85 and is idle otherwise."""
    driver = ProcessTrace("driver", 0, "h", [_span("pipeline", "in flight", 0, 100, -1)])
    stage = ProcessTrace("stage 0", 1, "h", [
        _span("device", "forward", 10, 30, 0), _span("device", "pool", 30, 40, 0),
        _span("device", "wait input", 35, 55, 1), _span("device", "forward", 60, 80, 1),
        _span("device", "wait send", 80, 85, 1), _span("host", "prepare", 55, 60, 1),
    ])  # fmt: skip
    s = summarize([driver, stage]).stages[0]
    assert (s.busy, s.wait_input, s.wait_send, s.fill, s.drain) == (0.5, 0.15, 0.0, 0.1, 0.2)
    assert s.host == pytest.approx(0.05)  # 55..60: the device waits for its host
    assert s.steps == 2 and s.busy_ms_per_step == 25 / 1e6
    # Stage 0's plan waits while the driver waits for a result: input, not host, for it.
    driver.spans.append(_span("loop", "wait result", 54, 58, 0))
    held = summarize([driver, stage]).stages[0]
    assert (held.wait_input, held.host) == pytest.approx((0.18, 0.02))
    driver.spans.pop()
    # A window's edge is a period's edge: 50..100 is 10 fill, 20 busy, 20 drain.
    w = summarize([driver, stage], since_ns=50).stages[0]
    assert (w.fill, w.busy, w.drain, w.wait_input, w.host) == (0.2, 0.4, 0.4, 0.0, 0.0)


def test_clock_offsets_from_pings():
    # The remote clock runs 1,000,000 ns ahead; answers arrive after 10..50 us round trips.
    truth = -1_000_000
    samples = [(t, t + rtt // 3 - truth, t + rtt) for t, rtt in
               [(0, 50_000), (100_000, 10_000), (200_000, 30_000)]]  # fmt: skip
    offset, error = estimate_offset(samples)
    assert abs(offset - truth) <= error == 5_000
    assert offset_for("host-a", "host-a", samples) == 0  # one host: one clock, no estimate
    assert offset_for("host-a", "host-b", samples) == offset


def test_chrome_events_keep_the_newest_within_a_window():
    trace = ProcessTrace("stage 0", 1, "h", [_span("device", "forward", 1000 * i, 1000 * i + 500, i)
                                            for i in range(10)], offset_ns=7)  # fmt: skip
    events = [e for e in chrome_events([trace], since_ns=4000, until_ns=6600) if e["ph"] == "X"]
    assert [e["args"]["step"] for e in events] == [4, 5, 6]
    assert events[0]["ts"] == 0 and events[1]["ts"] == 1.0 and events[0]["dur"] == 0.5


def test_the_trace_file_says_when_its_time_zero_was(tmp_path):
    """A timeline's times start at its first span; the file gives that instant on the
    driver's clock, so a gap before the first span can be measured from a known moment."""
    trace = ProcessTrace("stage 0", 1, "h", [_span("device", "forward", 1000 * i, 1000 * i + 500, i)
                                            for i in range(10)], offset_ns=7)  # fmt: skip
    write_chrome_trace(tmp_path / "t.json", [trace], since_ns=4000, until_ns=6600)
    document = json.loads((tmp_path / "t.json").read_text())
    assert document["otherData"]["origin_ns"] == 4007  # span 4's start, on the driver's clock


def test_bench_trace_covers_the_timed_passes_and_lands_in_the_json(qwen3_path, tmp_path):
    path, out = tmp_path / "bench.json", tmp_path / "rows.json"
    args = ["bench", "--model", str(qwen3_path), "--workload", "W1", "--requests", "6",
            "--no-peer", "--max-num-batched-tokens", "512", "--trace", str(path),
            "--warm-up-passes", "1", "--passes", "2",
            "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    row = json.loads(out.read_text())[0]
    stages = row["trace"]["stages"]
    assert [s["stage"] for s in stages] == ["stage 0"]
    for s in stages:
        total = s["busy"] + s["wait_input"] + s["wait_send"] + s["host"] + s["fill"] + s["drain"]
        assert total == pytest.approx(1.0, abs=1e-3)
    # Only the two timed passes (--passes 2): not the warm-up's steps.
    _, _, spans = _load(path)
    scheduled = sum(e["args"]["tokens"] for e in spans if e["name"] == "schedule")
    assert scheduled == 2 * row["tokens"]


class _FakeCuda:
    """Just enough of torch.cuda for CudaClock: events take the device timer's reading when
    recorded (the device is never behind), and the timer runs 0.05% fast against the host."""

    DRIFT = 1.0005

    def __init__(self) -> None:
        import time

        self.base = time.monotonic_ns()
        self.created = 0
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t_ms = None
                fake.created += 1

            def record(self, stream=None):
                self.t_ms = (time.monotonic_ns() - fake.base) * fake.DRIFT / 1e6
                self.stream = stream

            def query(self):
                return True

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                return other.t_ms - self.t_ms

        class Stream:
            def __init__(self, device=None):
                self.waited = []

            def synchronize(self):
                pass

        self.Event, self.Stream = Event, Stream
        self.main = Stream()
        self.current = self.main

    def current_stream(self, device=None):
        return self.current

    def synchronize(self, device=None):
        pass

    def stream(self, s):
        import contextlib

        @contextlib.contextmanager
        def switch():
            before, self.current = self.current, s
            try:
                yield
            finally:
                self.current = before

        return switch()


def test_cuda_device_spans_map_onto_the_host_clock_drift_corrected():
    from types import SimpleNamespace

    from pipepool.tracing.device import CudaClock
    from pipepool.tracing.recorder import now

    fake = _FakeCuda()
    clock = CudaClock("cuda:0")
    clock._torch = SimpleNamespace(cuda=fake)
    windows = []
    for step in range(50):
        h0 = now()
        mark = clock.begin()
        sum(range(20000))  # some host time between the events
        clock.end(mark, "forward", step, 8, 1)
        h1 = now()
        windows.append((h0, h1))

    class Work:
        def wait(self):
            fake.current.waited.append(self)

    mark = clock.begin()
    clock.transfer(mark, "nccl send", Work(), 50, 8, 1)
    assert fake.current is fake.main and fake.main.waited == []  # waited on the side stream
    assert clock._side.waited
    assert fake.created < 12  # 5 for the anchor; the 102 marks reuse finished events
    spans = clock.export()
    forwards = [s for s in spans if s.name == "forward"]
    assert [s.step for s in forwards] == list(range(50))
    for s, (h0, h1) in zip(forwards, windows, strict=True):
        # within 20 us of where the host saw it, after 0.05% of drift was taken out
        assert h0 - 20_000 <= s.start_ns <= s.end_ns <= h1 + 20_000
    (send,) = [s for s in spans if s.name == "nccl send"]
    assert send.track == "transfer" and send.step == 50


def test_dp2_trace_holds_every_replicas_processes_and_a_summary_of_each(bert_path, tmp_path):
    """Replicas are one Pipeline behind the Engine like one pipeline is: write_trace gathers
    each replica's driver and stages (their own processes) into one file."""
    path = tmp_path / "dp2.json"
    with Engine(
        str(bert_path), data_parallel_size=2, pipeline_parallel_size=2, trace=str(path),
        max_num_batched_tokens=64,
    ) as engine:  # fmt: skip
        engine.pool(_prompts(40), pooling="mean")
        summary = engine.write_trace()
    processes, _threads, spans = _load(path)
    names = sorted(processes.values())
    assert names == sorted(
        f"replica {r} {p}" for r in (0, 1) for p in ("driver", "stage 0", "stage 1")
    ), names
    assert [s.stage for s in summary.stages] == ["r0 stage 0", "r0 stage 1", "r1 stage 0",
                                                "r1 stage 1"]  # fmt: skip
    busy = {processes[s["pid"]] for s in spans if s["name"] == "forward"}
    assert any(n.startswith("replica 0") for n in busy) and any(
        n.startswith("replica 1") for n in busy
    ), busy
    assert summary.seconds > 0 and "r1 stage 1" in summary.text()
