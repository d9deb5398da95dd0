"""Issue 11: pipelines launched by torchrun on the CPU (gloo), as a user would run them.

Two layouts: one host with ``--nproc-per-node 2``, and two "hosts" on this machine (two
``torchrun --nnodes 2 --node-rank 0|1 --nproc-per-node 1`` commands sharing a rendezvous on
127.0.0.1), for ``pipepool embed`` and ``pipepool serve``; vectors equal PP=1's, and every
process exits with code 0.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from tiny_models import MIN_COSINE, cosine, long_prompts

import pipepool

# Slow: torchrun launches.
pytestmark = pytest.mark.slow

BUDGET = "16"  # tokens per step: the long prompts chunk
_TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(layout: str, args: list[str], tmp_path: Path) -> list[subprocess.Popen]:
    """Start ``python -m pipepool ARGS`` under torchrun in ``layout`` (one-host | two-hosts);
    returns the torchrun processes (node 0 first)."""
    run = [sys.executable, "-m", "torch.distributed.run"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    if layout == "one-host":
        nodes = [["--standalone", "--nproc-per-node", "2"]]
    else:
        port = str(_free_port())
        rdzv = ["--master-addr", "127.0.0.1", "--master-port", port]
        nodes = [
            ["--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1", *rdzv] for n in (0, 1)
        ]
    procs = []
    for n, node in enumerate(nodes):
        log = (tmp_path / f"node{n}.log").open("w")
        cmd = [*run, *node, "-m", "pipepool", *args]
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
    return procs


def _wait_all(procs: list[subprocess.Popen], tmp_path: Path) -> list[int]:
    try:
        return [p.wait(timeout=_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _logs(tmp_path: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(tmp_path.glob("node*.log")))


@pytest.fixture(scope="module")
def pp1_vectors(qwen3_path) -> np.ndarray:
    with pipepool.Engine(str(qwen3_path), max_num_batched_tokens=int(BUDGET)) as engine:
        return engine.embed(long_prompts())


@pytest.mark.parametrize("layout", ["one-host", "two-hosts"])
def test_torchrun_embed_matches_one_stage(qwen3_path, pp1_vectors, layout, tmp_path):
    """Every rank runs the same command; rank 0 plans the deployment, drives and writes."""
    inputs = tmp_path / "inputs.txt"
    inputs.write_text("\n".join(long_prompts()))
    out = tmp_path / "pp2.npy"
    args = ["embed", "--model", str(qwen3_path), "--pp", "2", "--max-num-batched-tokens", BUDGET]
    procs = _torchrun(layout, [*args, "--input", str(inputs), "--output", str(out)], tmp_path)
    codes = _wait_all(procs, tmp_path)
    assert codes == [0] * len(procs), _logs(tmp_path)
    assert cosine(np.load(out), pp1_vectors).min() >= MIN_COSINE


@pytest.mark.parametrize("layout", ["one-host", "two-hosts"])
def test_torchrun_serve_matches_one_stage_and_stops_cleanly(
    qwen3_path, pp1_vectors, layout, tmp_path
):
    """Rank 0 serves HTTP, rank 1 is stage 1. SIGTERM to the server: it drains, stops the
    pipeline, and every process (server, stage, both torchrun agents) exits 0."""
    port = _free_port()
    args = ["serve", "--model", str(qwen3_path), "--pp", "2", "--max-num-batched-tokens", BUDGET]
    procs = _torchrun(layout, [*args, "--port", str(port)], tmp_path)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + _TIMEOUT_S
        while True:
            assert all(p.poll() is None for p in procs), _logs(tmp_path)
            assert time.monotonic() < deadline, _logs(tmp_path)
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        reply = httpx.post(
            f"{url}/v1/embeddings", json={"input": long_prompts()}, timeout=_TIMEOUT_S
        )
        assert reply.status_code == 200, reply.text
        got = np.array([d["embedding"] for d in reply.json()["data"]], dtype=np.float32)
        assert cosine(got, pp1_vectors).min() >= MIN_COSINE
        server = _rank0_pid(procs[0].pid)
        os.kill(server, signal.SIGTERM)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    codes = _wait_all(procs, tmp_path)
    assert codes == [0] * len(procs), _logs(tmp_path)


def _rank0_pid(agent_pid: int) -> int:
    """The pipepool process torchrun started as rank 0 (a child of node 0's agent)."""
    children = Path(f"/proc/{agent_pid}/task/{agent_pid}/children").read_text().split()
    for child in children:
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if b"RANK=0" in environ:
            return int(child)
    raise AssertionError(f"no rank 0 among torchrun's children {children}")
