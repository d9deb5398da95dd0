"""Issue 35 with ``--api-server-count 2``: two HTTP front-end processes on one port, each
serving both models of the server (the bundled MiniLM embedder and a BERT cross-encoder), each
linked to both models' replicas. Both processes list and answer both models, with the answers of
each model's own engine; a model's replica killed under load heals without costing the other
model a request, in either front end."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from test_api_servers import _children
from test_multi_model import _replica_pid
from test_replicas import _descendants
from test_server import ServerProcess, wait_for
from tiny_models import MIN_COSINE, SENTENCES, cosine, long_prompts

import pipepool

# Slow: real `pipepool serve` processes of several models and API servers.
pytestmark = pytest.mark.slow

TEXTS = [*SENTENCES[:3], *long_prompts()[1:3]]


@pytest.fixture(scope="module")
def server(tmp_path_factory, minilm_path, cross_encoder_path):
    root = tmp_path_factory.mktemp("multi-api")
    args = [
        "--model", f"embedder={minilm_path}",
        "--model", f"reranker={cross_encoder_path}",
        "--device", "cpu",
        "--api-server-count", "2",
        "--no-access-log",
    ]  # fmt: skip
    proc = ServerProcess(args, root / "server.log").wait_ready(timeout=240)
    try:
        wait_for(lambda: "with 2 API server processes" in proc.log(), timeout=120,
                 what="the second API server")  # fmt: skip
        yield proc
    finally:
        proc.proc.send_signal(signal.SIGTERM)
        try:
            proc.proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.proc.kill()
            raise


@pytest.fixture(scope="module")
def engines(minilm_path, cross_encoder_path):
    made = {
        "embedder": pipepool.Engine(str(minilm_path), device="cpu"),
        "reranker": pipepool.Engine(str(cross_encoder_path), device="cpu"),
    }
    yield made
    for engine in made.values():
        engine.close()


def _running(server, module: str) -> int:
    """How many processes below the server run ``module``."""
    found = 0
    for pid, _start in _descendants(server.proc.pid):
        try:
            found += module in Path(f"/proc/{pid}/cmdline").read_bytes().decode()
        except OSError:
            continue
    return found


def _fresh(server, method: str, path: str, **kwargs) -> httpx.Response:
    """On a connection of its own: the kernel hands each to either front end."""
    return httpx.request(method, server.url + path, timeout=120, **kwargs)


def _health_by_process(server, tries: int = 400) -> dict[int, dict]:
    """/health as each front-end process answers it, until both have."""
    seen: dict[int, dict] = {}
    for _ in range(tries):
        r = _fresh(server, "GET", "/health")
        if r.status_code == 200:
            seen[r.json()["api_server"]] = r.json()
        if len(seen) == 2:
            break
    return seen


def _check_answers(server, engines, requests: int = 16) -> None:
    embedder, reranker = engines["embedder"], engines["reranker"]
    want_vectors = embedder.embed(TEXTS)
    docs = TEXTS[1:]
    want_scores = reranker.score([TEXTS[0]] * len(docs), docs)
    for _ in range(requests):
        body = {"model": "embedder", "input": TEXTS}
        out = _fresh(server, "POST", "/v1/embeddings", json=body).json()
        for row, want in zip(out["data"], want_vectors, strict=True):
            assert cosine(np.array(row["embedding"]), want) >= MIN_COSINE
        body = {"model": "reranker", "query": TEXTS[0], "documents": docs}
        out = _fresh(server, "POST", "/rerank", json=body).json()
        for r in out["results"]:
            assert abs(r["relevance_score"] - float(want_scores[r["index"]])) <= 1e-5


def test_both_front_ends_serve_both_models_with_their_own_answers(server, engines):
    by_process = _health_by_process(server)
    assert set(by_process) == {0, 1}
    for body in by_process.values():
        assert body["status"] == "ok"
        assert set(body["models"]) == {"embedder", "reranker"}
    assert len(_children(server, "pipepool.server.api_worker")) == 1
    # One replica process per model, shared by both front ends (each its own socket folder).
    assert len(_children(server, "pipepool.replicas.worker")) == 2
    # Beside another model each model tokenises large batches in a helper: one per model and
    # front end.
    assert _running(server, "pipepool.intake.tokenizer_process") == 4
    _check_answers(server, engines)


def test_a_killed_model_heals_in_both_front_ends_and_the_other_loses_nothing(server, engines):
    pid = _replica_pid(server, "reranker")
    stop = threading.Event()
    answers: dict[str, list[int]] = {"embedder": [], "reranker": []}
    bodies = {
        "embedder": ("/v1/embeddings", {"model": "embedder", "input": TEXTS}),
        "reranker": ("/rerank", {"model": "reranker", "query": TEXTS[0], "documents": TEXTS}),
    }

    def load(name: str) -> None:
        path, body = bodies[name]
        while not stop.is_set():
            answers[name].append(_fresh(server, "POST", path, json=body).status_code)

    threads = [threading.Thread(target=load, args=(n,)) for n in bodies for _ in range(3)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 60
        while min(len(a) for a in answers.values()) < 3:  # under load: answers on both
            assert time.monotonic() < deadline, "no answers under load"
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        while _replica_pid(server, "reranker") in (pid, None):
            assert time.monotonic() < deadline, "the reranker did not come back"
            time.sleep(0.2)
        back = len(answers["reranker"])
        while len(answers["reranker"]) < back + 6:  # answered through the new process
            assert time.monotonic() < deadline, "the reranker answers nothing"
            time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert set(answers["embedder"]) == {200}
    assert set(answers["reranker"]) <= {200, 503}
    # Both front ends linked to the new process: each answers the reranker as it should.
    by_process = _health_by_process(server)
    assert {k: b["models"]["reranker"]["status"] for k, b in by_process.items()} == {
        0: "ok",
        1: "ok",
    }
    _check_answers(server, engines)
