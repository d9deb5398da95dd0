"""Issue 35: models of one server sharing a GPU keep their steps short while another has
work (``driver/shared_gpu.py``). Who neighbours whom, the board between processes, the cap on
a pipeline's steps (and its results unchanged under it), and the server's plan."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
from tiny_models import MIN_COSINE, cosine, long_prompts

import pipepool
from pipepool.commands import serve
from pipepool.config import EngineConfig, GpuNeighbours
from pipepool.core.scheduler import Scheduler
from pipepool.driver.shared_gpu import SharedGpu, create_board, plan_neighbours
from pipepool.errors import InvalidInputError

BUDGET, CAP = 64, 16


def _stamp(board, slot: int, ns: int) -> None:
    slots = np.memmap(board, dtype=np.int64, mode="r+")
    slots[slot] = ns
    slots.flush()


def test_neighbours_are_the_other_models_on_one_of_a_models_gpus():
    devices = [("cuda:0",), ("cuda:0", "cuda:1"), ("cuda:1",), ("cuda:2",), ("cuda:0",)]
    assert plan_neighbours(devices) == [(1, 4), (0, 2, 4), (1,), (), (0, 1)]
    assert plan_neighbours([("cpu",), ("cpu", "cpu")]) == [(), ()]  # cores are not time-sliced


def test_a_neighbour_caps_the_step_only_within_its_window(tmp_path):
    board = str(tmp_path / "board")
    create_board(board, 3)
    mine = SharedGpu(GpuNeighbours(board, 0, (1,)), CAP, active_s=5.0)
    theirs = SharedGpu(GpuNeighbours(board, 1, (0,)), CAP, active_s=5.0)
    stranger = SharedGpu(GpuNeighbours(board, 2, (1,)), CAP, active_s=5.0)
    assert mine.step_cap() is None  # nobody has had work
    stranger.had_work()  # not on my GPUs
    assert mine.step_cap() is None
    theirs.had_work()
    assert mine.step_cap() == CAP
    assert theirs.step_cap() is None  # my own slot is still empty
    _stamp(board, 1, time.monotonic_ns() - 6 * 10**9)  # their work ended 6 s ago
    assert mine.step_cap() is None
    assert SharedGpu.open(None, CAP) is None
    assert SharedGpu.open(GpuNeighbours(board, 0, (1,)), 0) is None  # no cap asked for


def test_another_process_stamps_the_board(tmp_path):
    board = str(tmp_path / "board")
    create_board(board, 2)
    code = (
        "import sys\n"
        "from pipepool.config import GpuNeighbours\n"
        "from pipepool.driver.shared_gpu import SharedGpu\n"
        "SharedGpu(GpuNeighbours(sys.argv[1], 1, (0,)), 16).had_work()\n"
    )
    before = time.monotonic_ns()
    subprocess.run([sys.executable, "-c", code, board], check=True, timeout=120)
    slot = int(np.fromfile(board, dtype=np.int64)[1])
    assert before < slot <= time.monotonic_ns()
    assert SharedGpu(GpuNeighbours(board, 0, (1,)), CAP, active_s=600).step_cap() == CAP


@pytest.fixture
def plan_sizes(monkeypatch) -> list[int]:
    """Token counts of every plan any scheduler in this process builds."""
    sizes: list[int] = []
    schedule = Scheduler.schedule

    def recorded(self, max_tokens=None):
        plan = schedule(self, max_tokens)
        if plan is not None:
            sizes.append(plan.num_tokens)
        return plan

    monkeypatch.setattr(Scheduler, "schedule", recorded)
    return sizes


def test_a_pipeline_keeps_its_steps_short_while_a_neighbour_has_work(
    qwen3_path, reference, tmp_path, plan_sizes
):
    """Chunked prompts longer than the cap, steps of at most CAP tokens while the neighbour's
    stamp is in the window, the whole budget once it is not; the vectors are the reference's
    either way, and the pipeline stamps its own slot."""
    board = str(tmp_path / "board")
    create_board(board, 2)
    ref = reference(qwen3_path)
    prompts = long_prompts()
    assert max(len(ref.token_ids(p)) for p in prompts) > BUDGET
    options = dict(max_num_batched_tokens=BUDGET, normalize=False, shared_gpu_step_tokens=CAP)
    neighbours = GpuNeighbours(board, 0, (1,))
    with pipepool.Engine(str(qwen3_path), gpu_neighbours=neighbours, **options) as engine:
        _stamp(board, 1, time.monotonic_ns() + 3600 * 10**9)  # busy for the next hour
        capped = engine.submit(prompts, pooling="last").result(timeout=120)
        assert plan_sizes and max(plan_sizes) <= CAP
        assert np.fromfile(board, dtype=np.int64)[0] > 0  # it told its neighbour
        _stamp(board, 1, 0)  # the neighbour went quiet
        plan_sizes.clear()
        whole = engine.submit(prompts, pooling="last").result(timeout=120)
        assert max(plan_sizes) > CAP
    for p, a, b in zip(prompts, capped, whole, strict=True):
        want = ref.pooled(ref.token_ids(p), "last")
        assert cosine(a, want).min() >= MIN_COSINE
        assert cosine(b, want).min() >= MIN_COSINE


def test_replica_processes_share_the_board(bert_path, tmp_path):
    """The board crosses into replica processes with the config: they stamp the model's slot,
    and their steps hold CAP tokens at most (as many steps as that takes, by the counters)."""
    board = str(tmp_path / "board")
    create_board(board, 2)
    _stamp(board, 1, time.monotonic_ns() + 3600 * 10**9)
    texts = [" ".join(["word"] * n) for n in (3, 9, 14, 5, 11, 2, 13, 7)]
    with pipepool.Engine(
        str(bert_path), data_parallel_size=2, max_num_batched_tokens=BUDGET,
        shared_gpu_step_tokens=CAP, gpu_neighbours=GpuNeighbours(board, 0, (1,)),
    ) as engine:  # fmt: skip
        before = engine.stats
        engine.embed(texts)
        after = engine.stats
    tokens = after.scheduled_tokens - before.scheduled_tokens
    steps = after.steps - before.steps
    assert tokens > BUDGET and steps >= -(-tokens // CAP)
    assert np.fromfile(board, dtype=np.int64)[0] > 0


def test_the_server_gives_models_on_one_gpu_a_board(monkeypatch, tmp_path):
    monkeypatch.setattr(serve.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    cfg = EngineConfig(shared_gpu_step_tokens=512)

    def planned(name, *devices):
        return SimpleNamespace(name=name, config=cfg, devices=devices)

    models = [planned("a", "cuda:0"), planned("b", "cuda:1"), planned("c", "cuda:0")]
    a, b, c = serve._gpu_neighbours(models)
    assert a.gpu_neighbours == GpuNeighbours(str(tmp_path / "board"), 0, (2,))
    assert b.gpu_neighbours is None and b == cfg
    assert c.gpu_neighbours.neighbours == (0,)
    assert np.fromfile(tmp_path / "board", dtype=np.int64).tolist() == [0, 0, 0]
    assert SharedGpu.open(a.gpu_neighbours, a.shared_gpu_step_tokens).step_cap() is None
    on_cpu = [planned("a", "cpu"), planned("b", "cpu")]
    assert serve._gpu_neighbours(on_cpu) == [cfg, cfg]


def test_the_cap_is_a_serve_option_checked_once():
    with pytest.raises(InvalidInputError, match="shared_gpu_step_tokens"):
        EngineConfig(shared_gpu_step_tokens=-1)
    served = subprocess.run(
        [sys.executable, "-m", "pipepool", "serve", "--help"], capture_output=True, text=True
    )
    embedded = subprocess.run(
        [sys.executable, "-m", "pipepool", "embed", "--help"], capture_output=True, text=True
    )
    assert "--shared-gpu-step-tokens" in served.stdout
    assert "--shared-gpu-step-tokens" not in embedded.stdout
