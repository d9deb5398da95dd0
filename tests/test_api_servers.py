"""``pipepool serve --api-server-count 2``: two HTTP front-end processes on one port, sharing one
replica (tiny Qwen3, a budget small enough that prompts chunk). Both answer, with vectors equal
to one pipeline's; a replica killed under load loses no request of either; a killed front-end
process is started again; SIGTERM leaves no process behind."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
from test_replicas import _descendants, _prompts
from test_server import ServerProcess, _alive, _server_timing, wait_for
from tiny_models import MIN_COSINE, cosine

import pipepool

# Slow: real `pipepool serve` processes with several API server processes.
pytestmark = pytest.mark.slow

BUDGET = 32


@pytest.fixture(scope="module")
def server(qwen3_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("api-servers") / "serve.log"
    args = ["--model", str(qwen3_path), "--api-server-count", "2", "--no-access-log"]
    # The tokenizer as a user's server has it (conftest's switch left out): each front end
    # makes its batch calls on its own threads (``intake.batch_threads``).
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    proc = ServerProcess([*args, "--max-num-batched-tokens", str(BUDGET)], log, env)
    try:
        proc.wait_ready(timeout=240)
        wait_for(lambda: "with 2 API server processes" in proc.log(), timeout=120,
                 what="the second API server")  # fmt: skip
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def one_pipeline(qwen3_path):
    with pipepool.Engine(str(qwen3_path), max_num_batched_tokens=BUDGET) as engine:
        yield engine


def _children(server: ServerProcess, module: str) -> list[tuple[int, str]]:
    found = []
    for pid, start in server.children():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
        except OSError:
            continue
        if module in cmdline:
            found.append((pid, start))
    return found


def _answering(server: ServerProcess, want: set[int], tries: int = 400) -> set[int]:
    """Which front-end processes answer /health on fresh connections (the kernel picks one
    per connection), until every one of ``want`` has."""
    seen: set[int] = set()
    for _ in range(tries):
        r = httpx.get(server.url + "/health", timeout=10)
        if r.status_code == 200:
            seen.add(r.json()["api_server"])
        if want <= seen:
            break
    return seen


def _post_all(server: ServerProcess, requests: list[list[str]], clients: int):
    """Start ``clients`` threads posting ``requests``; (results, threads): join, then read."""
    results: list = [None] * len(requests)

    def client(k: int) -> None:
        for i in range(k, len(requests), clients):
            # A fresh connection per request: each may land on either process.
            results[i] = httpx.post(
                server.url + "/v1/embeddings", json={"input": requests[i]}, timeout=180
            )

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    return results, threads


def _check(results: list, requests: list[list[str]], one_pipeline) -> None:
    failed = [(r.status_code, r.text) for r in results if r.status_code != 200]
    assert not failed, failed[:3]
    expected = iter(one_pipeline.embed([p for req in requests for p in req]))
    for r in results:
        for d in r.json()["data"]:
            assert cosine(np.asarray(d["embedding"], np.float32), next(expected)) >= MIN_COSINE


def test_both_api_servers_answer_with_one_pipelines_vectors(server, one_pipeline):
    assert _answering(server, {0, 1}) == {0, 1}
    requests = [_prompts(24)[i : i + 1 + i % 2] for i in range(24)]
    results, threads = _post_all(server, requests, clients=8)
    for t in threads:
        t.join()
    _check(results, requests, one_pipeline)
    assert len(_children(server, "pipepool.replicas.worker")) == 1
    assert len(_children(server, "pipepool.server.api_worker")) == 1
    m = server.metrics()
    assert m['pipepool_replica_up{replica="0"}'] == 1
    assert m["process_cpu_seconds_total"] > 0


def test_server_timing_tells_the_replicas_part_of_the_engines_wait(server):
    """Over a replica, ``replica`` (from the batch's arrival in the replica's process to its
    outputs there) lies within ``tokenize`` (which ends with the batch sent) and ``engine``
    (from then to the outputs in the front end), on either front end."""
    seen = set()
    for _ in range(40):
        with httpx.Client(timeout=60) as http:
            index = http.get(server.url + "/health").json()["api_server"]
            r = http.post(server.url + "/v1/embeddings", json={"input": _prompts(2)})
        assert r.status_code == 200
        spent = _server_timing(r)
        assert {"app", "tokenize", "engine", "replica"} <= set(spent), spent
        assert 0 < spent["replica"] <= spent["tokenize"] + spent["engine"] <= spent["app"], spent
        seen.add(index)
        if seen == {0, 1}:
            break
    assert seen == {0, 1}


def test_replica_killed_under_load_loses_no_request_of_either_api_server(server, one_pipeline):
    requests = [_prompts(40)[i % 40 : i % 40 + 1 + i % 3] for i in range(96)]
    (replica,) = _children(server, "pipepool.replicas.worker")
    results, threads = _post_all(server, requests, clients=32)
    wait_for(lambda: server.metrics()["pipepool_server_pending_inputs"] > 0, what="work")
    os.kill(replica[0], signal.SIGKILL)
    for t in threads:
        t.join()
    _check(results, requests, one_pipeline)  # every request waited for the new process
    assert not _alive(replica)
    wait_for(lambda: _answering(server, {0, 1}) == {0, 1}, timeout=60, what="both serving")
    up = 'pipepool_replica_up{replica="0"}'
    for k in (0, 1):  # both front ends see the replica back (restarted once)
        wait_for(lambda k=k: _metric_on(server, k, up) == 1, what=f"replica up on API server {k}")
        assert _metric_on(server, k, 'pipepool_replica_restarts_total{replica="0"}') == 1


def _metric_on(server: ServerProcess, index: int, name: str, tries: int = 400) -> float:
    """``name`` from /metrics as API server ``index`` reports it (fresh connections until it
    answers one; its /health on the same connection says which process that is)."""
    for _ in range(tries):
        with httpx.Client(timeout=10) as http:
            if http.get(server.url + "/health").json().get("api_server") != index:
                continue
            text = http.get(server.url + "/metrics").text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        return float("nan")
    pytest.fail(f"API server {index} never answered")


def test_killed_api_server_is_started_again(server, one_pipeline):
    (worker,) = _children(server, "pipepool.server.api_worker")
    os.kill(worker[0], signal.SIGKILL)
    wait_for(lambda: [w for w in _children(server, "pipepool.server.api_worker") if w != worker],
             timeout=60, what="a new API server process")  # fmt: skip
    wait_for(lambda: _answering(server, {1}, tries=50) >= {1}, timeout=60, what="it serving")
    assert "API server 1" in server.log() and "starting it again" in server.log()
    requests = [_prompts(8)[i : i + 1] for i in range(8)]
    results, threads = _post_all(server, requests, clients=4)
    for t in threads:
        t.join()
    _check(results, requests, one_pipeline)


def test_sigterm_stops_every_front_end_and_replica(server):
    family = _descendants(server.proc.pid)
    assert len(family) == 2  # the replica (PP=1: its stage in its own process) and a front end
    assert server.stop() == 0, server.log()
    assert not [p for p in family if _alive(p)], "processes left behind"


def test_bad_api_server_options_are_refused_before_anything_starts():
    from pipepool.commands.serve import _check_api_servers
    from pipepool.server.settings import ServerSettings

    with pytest.raises(pipepool.InvalidInputError, match="api_server_count must be >= 1"):
        ServerSettings(api_server_count=0)
    with pytest.raises(pipepool.InvalidInputError, match="--trace follows one pipeline"):
        _check_api_servers(pipepool.EngineConfig(trace="t.json"), under_torchrun=False)
    with pytest.raises(pipepool.InvalidInputError, match="under torchrun run one API server"):
        _check_api_servers(pipepool.EngineConfig(), under_torchrun=True)


def test_api_server_count_auto_is_sized_to_the_cores_and_one_where_more_cannot_run(monkeypatch):
    from pipepool.commands import serve
    from pipepool.commands.cli import build_parser
    from pipepool.server.api_servers import auto_api_server_count

    assert [auto_api_server_count(c) for c in (1, 2, 7, 8, 12, 16, 31, 64, 256)] == [
        1, 1, 1, 4, 6, 8, 8, 8, 8,
    ]  # fmt: skip

    def parsed(*argv: str) -> int | str:
        return build_parser("serve").parse_args(["serve", *argv]).api_server_count

    monkeypatch.delenv("PIPEPOOL_API_SERVER_COUNT", raising=False)
    assert parsed() == "auto"
    assert parsed("--api-server-count", "3") == 3
    monkeypatch.setenv("PIPEPOOL_API_SERVER_COUNT", "auto")
    assert parsed() == "auto"

    monkeypatch.setattr(serve, "auto_api_server_count", lambda: 8)  # a 16-core host
    config = pipepool.EngineConfig()
    assert serve._front_ends("auto", config, under_torchrun=False) == 8
    assert serve._front_ends("auto", config, under_torchrun=True) == 1
    assert serve._front_ends("auto", config.replace(trace="t.json"), under_torchrun=False) == 1
    assert serve._front_ends(2, config, under_torchrun=False) == 2
    with pytest.raises(pipepool.InvalidInputError, match="--trace follows one pipeline"):
        serve._front_ends(2, config.replace(trace="t.json"), under_torchrun=False)


@pytest.mark.parametrize("value", ["two", "1.5", ""])
def test_a_bad_api_server_count_is_refused_naming_it(value, monkeypatch, capsys):
    from pipepool.commands.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser("serve").parse_args(["serve", "--api-server-count", value])
    assert "expected a whole number of processes or auto" in capsys.readouterr().err
    monkeypatch.setenv("PIPEPOOL_API_SERVER_COUNT", value or " ")
    with pytest.raises(SystemExit):
        build_parser("serve").parse_args(["serve"])
    assert "PIPEPOOL_API_SERVER_COUNT" in capsys.readouterr().err
