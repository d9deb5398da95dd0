"""Issue 14 acceptance: data-parallel replicas (DP=2 x PP=2, four stage processes on gloo)
through the API and a real server, equal to one pipeline per request; a replica or a stage of
one killed under load loses no request, comes back, and leaves no process behind."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import numpy as np
import pytest
from test_server import ServerProcess, _alive, _parent, _processes, wait_for
from tiny_models import MIN_COSINE, SENTENCES, cosine, long_prompts

import pipepool
from pipepool.core.restarts import RestartPolicy
from pipepool.errors import InvalidInputError
from pipepool.replicas import placement as placement_mod
from pipepool.replicas.handle import Rates
from pipepool.replicas.messages import Snapshot
from pipepool.replicas.pipeline import ReplicaPipeline
from pipepool.replicas.routing import split_rows

# Slow: replica processes, killed and restarted.
pytestmark = pytest.mark.slow

BUDGET = 32  # small, so long prompts take several steps on every replica
OPTIONS = {"max_num_batched_tokens": BUDGET}


def _prompts(count: int) -> list[str]:
    pool = long_prompts() + SENTENCES
    return [f"{i}: {pool[(i * 7) % len(pool)]}" for i in range(count)]


def _descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of every process below ``pid``."""
    procs = _processes()
    found, frontier = [], {pid}
    while frontier:
        children = [p for p in procs if _parent(p) in frontier]
        found += children
        frontier = {p[0] for p in children}
    return found


# -- routing and placement (no processes) ----------------------------------------------------


def test_small_batches_go_whole_to_the_least_loaded_replica():
    assert split_rows(np.array([5, 7, 9]), np.array([300, 20, 40]), 64) == [(1, 0, 3)]


def test_large_batches_fill_replicas_to_one_level_in_contiguous_ranges():
    lengths = np.full(100, 10)
    # Equal loads: halves. Replica 0 already 500 tokens ahead: it takes 250 of the 1,000.
    assert split_rows(lengths, np.array([0, 0]), 64) == [(0, 0, 50), (1, 50, 100)]
    assert split_rows(lengths, np.array([500, 0]), 64) == [(1, 0, 75), (0, 75, 100)]
    # A replica above the common level gets nothing.
    assert split_rows(lengths, np.array([5000, 0, 0]), 64) == [(1, 0, 50), (2, 50, 100)]


def test_replica_rates_come_from_its_cumulative_counters():
    rates = Rates(window_s=10.0)
    rates.add(Snapshot("ok", prompt_tokens_finished=0, stage_busy_s=(0.0, 0.0)), now=0.0)
    rates.add(Snapshot("ok", prompt_tokens_finished=500, stage_busy_s=(1.0, 0.5)), now=1.0)
    rates.add(Snapshot("ok", prompt_tokens_finished=1000, stage_busy_s=(1.5, 1.0)), now=2.0)
    assert rates.tokens_per_s() == 500.0
    assert rates.busy_fraction() == (2.5 / 2) / 2.0  # mean over its two stages
    rates.add(Snapshot("ok", prompt_tokens_finished=1000, stage_busy_s=(1.5, 1.0)), now=30.0)
    assert rates.tokens_per_s() < 500.0  # old samples leave the window


def test_gpu_placement_is_replica_major_or_shared(monkeypatch):
    import torch

    monkeypatch.setattr(placement_mod, "_device_kind", lambda device: "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = pipepool.EngineConfig(data_parallel_size=2, pipeline_parallel_size=2)
    placed = placement_mod.plan_placement(config)
    assert [p.devices for p in placed] == [("cuda:0", "cuda:1"), ("cuda:2", "cuda:3")]
    assert [p.visible_devices for p in placed] == ["0,1", "2,3"]
    assert all(p.config.data_parallel_size == 1 for p in placed)
    shared = placement_mod.plan_placement(
        config.replace(pipeline_parallel_size=1, replicas_per_gpu=2)
    )
    assert [p.devices for p in shared] == [("cuda:0",), ("cuda:0",)]
    assert [p.config.gpu_memory_share for p in shared] == [0.5, 0.5]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert placement_mod.plan_placement(config)[1].visible_devices == "6,7"
    with pytest.raises(InvalidInputError, match="needs 6 GPUs, 4 visible"):
        placement_mod.plan_placement(config.replace(data_parallel_size=3))


def test_bad_replica_options_are_refused_before_anything_starts(monkeypatch):
    with pytest.raises(InvalidInputError, match="data_parallel_size must be an integer >= 1"):
        pipepool.Engine(data_parallel_size=0)
    with pytest.raises(InvalidInputError, match="replicas_per_gpu"):
        pipepool.EngineConfig(replicas_per_gpu=0)
    with pytest.raises(InvalidInputError, match="more than the data_parallel_size=1 replicas"):
        pipepool.EngineConfig(replicas_per_gpu=2)
    with pytest.raises(pipepool.ModelLoadError, match="does not exist"):  # before any process
        pipepool.Engine("/no/such/model", data_parallel_size=2)
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(name, value)
    with pytest.raises(InvalidInputError, match="under torchrun run one pipeline across hosts"):
        pipepool.Engine(data_parallel_size=2)


# -- through the API -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(qwen3_path):
    """One pipeline, one stage: what every replica must reproduce."""
    with pipepool.Engine(str(qwen3_path), **OPTIONS) as engine:
        yield engine


@pytest.fixture(scope="module")
def replicated(qwen3_path, server_process):
    engine = pipepool.Engine(
        str(qwen3_path), data_parallel_size=2, pipeline_parallel_size=2, **OPTIONS
    )
    yield engine
    engine.close()


def test_api_dp2_pp2_matches_one_pipeline_and_uses_both_replicas(replicated, reference):
    assert isinstance(replicated, pipepool.Engine)
    assert isinstance(replicated.pipeline, ReplicaPipeline)
    assert replicated.health == "ok"
    assert [len(_descendants(s.pid)) for s in replicated.pipeline.replica_status()] == [1, 1]
    prompts = _prompts(60)  # ~3k tokens: split across both replicas
    got = replicated.embed(prompts)
    want = reference.embed(prompts)
    assert cosine(got, want).min() >= MIN_COSINE
    tokens = [s.prompt_tokens_finished for s in replicated.pipeline.replica_status()]
    assert min(tokens) > 0, tokens
    # Token embeddings and a small call (one replica) too.
    for g, w in zip(replicated.embed_tokens(prompts[:3]), reference.embed_tokens(prompts[:3]),
                    strict=True):  # fmt: skip
        assert g.shape == w.shape and cosine(g, w).min() >= MIN_COSINE
    assert cosine(replicated.embed(["A"]), reference.embed(["A"])).min() >= MIN_COSINE


def test_killed_replica_process_loses_nothing_and_is_restarted(replicated, reference):
    prompts = _prompts(120)
    want = reference.embed(prompts)
    victim = replicated.pipeline.replica_status()[0]
    submission = replicated.submit(prompts)
    wait_for(lambda: submission.num_done > 0, what="the first results")
    os.kill(victim.pid, signal.SIGKILL)
    got = submission.result(timeout=120)
    assert cosine(got, want).min() >= MIN_COSINE
    wait_for(lambda: replicated.health == "ok", timeout=60, what="the replica back")
    status = replicated.pipeline.replica_status()[0]
    assert status.restarts == 1 and status.pid != victim.pid
    assert replicated.stats.requests_retried > 0
    assert cosine(replicated.embed(prompts[:8]), want[:8]).min() >= MIN_COSINE


def test_calls_fail_only_once_every_replica_is_gone_and_no_process_is_left(replicated):
    """(Last of the API tests: it ends the shared engine.) With no restarts left (as
    stage_restarts=0 would give), a killed replica is given up on; its work moves on; only when
    the last one goes do calls fail, naming every replica's cause."""
    for slot in replicated.pipeline._slots:
        slot.policy = RestartPolicy(0)
    deaths = []
    replicated.pipeline.add_death_callback(deaths.append)
    pids = [s.pid for s in replicated.pipeline.replica_status()]
    family = [p for p in _processes() if p[0] in pids]
    family += [p for pid in pids for p in _descendants(pid)]
    assert len(family) == 4
    submission = replicated.submit(_prompts(120))
    wait_for(lambda: submission.num_done > 0, what="the first results")
    os.kill(pids[0], signal.SIGKILL)
    wait_for(
        lambda: replicated.pipeline.replica_status()[0].state == "failed", what="replica 0 given up"
    )
    assert replicated.health == "degraded" and not submission.done()
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(pipepool.EngineDeadError, match="all 2 replicas failed") as failed:
        submission.result(timeout=60)
    assert f"pid {pids[0]}" in str(failed.value) and f"pid {pids[1]}" in str(failed.value)
    assert replicated.health == "dead" and len(deaths) == 1
    with pytest.raises(pipepool.EngineDeadError, match="engine is dead: all 2 replicas"):
        replicated.embed(["x"])
    replicated.close()
    assert replicated.health == "closed"
    # The killed replicas' stage processes follow their parent on their own.
    wait_for(lambda: not [p for p in family if _alive(p)], what="every process gone")


# -- through the server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server_process(qwen3_path, tmp_path_factory):
    """The DP=2 x PP=2 server, started before the API engine so that the two start-ups
    overlap (each is mostly five interpreters importing torch)."""
    log = tmp_path_factory.mktemp("dp-server") / "serve.log"
    args = ["--model", str(qwen3_path), "--dp", "2", "--pp", "2", "--no-access-log"]
    proc = ServerProcess([*args, "--max-num-batched-tokens", str(BUDGET)], log)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def server(server_process):
    return server_process.wait_ready(timeout=240)


def _replica_pids(server: ServerProcess) -> list[int]:
    """The replicas' pids in replica order, as the server reports them (/metrics'
    ``pipepool_replica_info``): pids wrap around, so neither a pid's size nor the order of
    /proc says which replica it is."""
    found = re.compile(r'pipepool_replica_info\{replica="(\d+)",.*pid="(\d+)"\}')
    pids = dict(m.groups() for key in server.metrics() if (m := found.fullmatch(key)))
    return [int(pids[str(i)]) for i in range(len(pids))]


def test_server_dp2_pp2_matches_one_pipeline_and_reports_each_replica(server, reference):
    prompts = _prompts(40)
    r = httpx.post(server.url + "/v1/embeddings", json={"input": prompts}, timeout=120)
    assert r.status_code == 200, r.text
    got = np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)
    assert cosine(got, reference.embed(prompts)).min() >= MIN_COSINE
    health = httpx.get(server.url + "/health")
    assert health.json() == {"status": "ok", "replicas": ["ok", "ok"]}
    log = server.log()
    assert "replica 0: 2 stage(s): stage 0 -> cpu, stage 1 -> cpu" in log
    assert "replica 1: 2 stage(s)" in log
    m = server.metrics()
    for k in ("0", "1"):
        assert m[f'pipepool_replica_up{{replica="{k}"}}'] == 1
        assert f'pipepool_replica_busy_fraction{{replica="{k}"}}' in m
        assert f'pipepool_replica_tokens_per_second{{replica="{k}"}}' in m
        assert m[f'pipepool_replica_restarts_total{{replica="{k}"}}'] == 0
    assert len(_replica_pids(server)) == 2
    assert all(len(_descendants(pid)) == 1 for pid in _replica_pids(server))


def test_stage_killed_under_64_clients_fails_no_request_and_comes_back(server, reference):
    requests = [_prompts(40)[i % 40 : i % 40 + 1 + i % 3] for i in range(64 * 3)]
    expected = reference.embed([p for r in requests for p in r])
    results: list = [None] * len(requests)
    start = threading.Barrier(65)

    def client(k: int) -> None:
        with httpx.Client(timeout=180) as http:
            start.wait()
            for i in range(k, len(requests), 64):
                results[i] = http.post(server.url + "/v1/embeddings", json={"input": requests[i]})

    threads = [threading.Thread(target=client, args=(k,)) for k in range(64)]
    for t in threads:
        t.start()
    start.wait()
    replica0 = _replica_pids(server)[0]
    wait_for(
        lambda: server.metrics()['pipepool_replica_prompt_tokens_finished_total{replica="0"}'] > 0,
        what="replica 0 at work",
    )
    (stage,) = _descendants(replica0)
    os.kill(stage[0], signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: httpx.get(server.url + "/health").status_code == 503, what="degraded")
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "degraded" and health["replicas"][1] == "ok", health
    wait_for(lambda: httpx.get(server.url + "/health").status_code == 200, timeout=30,
             what="the replica back")  # fmt: skip
    recovered_s = time.monotonic() - killed
    for t in threads:
        t.join()
    failed = [r.status_code for r in results if r.status_code != 200]
    assert not failed, failed
    got = iter(expected)
    for r in results:
        for d in r.json()["data"]:
            assert cosine(np.asarray(d["embedding"], np.float32), next(got)).min() >= MIN_COSINE
    m = server.metrics()
    assert m['pipepool_replica_pipeline_restarts_total{replica="0"}'] == 1
    assert m['pipepool_replica_up{replica="0"}'] == 1
    assert not _alive(stage) and len(_descendants(replica0)) == 1
    print(f"replica 0 back {recovered_s:.1f} s after its stage was killed")


def test_sigterm_stops_every_replica_and_stage(server):
    family = [p for pid in _replica_pids(server) for p in [*_descendants(pid)]]
    family += server.children()
    assert len(family) == 4
    assert server.stop() == 0, server.log()
    assert not [p for p in family if _alive(p)], "processes left behind"


class _FinishedBeforeReturn:
    """A real pipeline whose ``enqueue`` returns only once the call is done: what its loop
    thread can do while the replica's reader thread, which enqueued, waits for the GIL."""

    def __init__(self, pipeline) -> None:
        self._pipeline = pipeline

    def __getattr__(self, name: str):
        return getattr(self._pipeline, name)

    def enqueue(self, submission, part) -> None:
        self._pipeline.enqueue(submission, part)
        submission.result(timeout=60)


def test_a_replica_forwards_rows_its_pipeline_finished_before_enqueue_returned(bert_path):
    import socket as socketlib
    from multiprocessing.connection import Connection

    from pipepool.core.request import PoolingParams
    from pipepool.replicas.messages import Report, Stop, Work, receive, send
    from pipepool.replicas.worker import ReplicaServer

    with pipepool.Engine(str(bert_path)) as engine:
        ids = engine.tokenize(SENTENCES[:3])
        token_ids, lengths = np.concatenate(ids), np.array([len(t) for t in ids])
        params = PoolingParams("mean", normalize=True)
        expected = engine.submit_tokens(token_ids, lengths, params).result()
        ours, theirs = socketlib.socketpair()
        front, back = Connection(ours.detach()), Connection(theirs.detach())
        replica = ReplicaServer(_FinishedBeforeReturn(engine.pipeline), back, owner=False)
        serving = threading.Thread(target=replica.run, daemon=True)
        serving.start()
        send(front, [Work(100, token_ids, lengths, params)])
        rows, values = [], []
        deadline = time.monotonic() + 30  # reports come every 0.5 s, with results or not
        while len(rows) < len(lengths):
            assert time.monotonic() < deadline, f"rows {rows} of {len(lengths)} came back"
            if not front.poll(1):
                continue
            for report in receive(front):
                if isinstance(report, Report):
                    for result in report.results:
                        assert result.first_id == 100
                        rows += result.rows.tolist()
                        values += list(result.values)
        send(front, [Stop()])
        serving.join(10)
        front.close()
    assert sorted(rows) == [0, 1, 2]
    got = np.array(values)[np.argsort(rows)]
    assert cosine(got, expected).min() >= MIN_COSINE
