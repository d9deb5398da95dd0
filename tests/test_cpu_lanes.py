"""CPU lanes (layers/cpu_lanes.py): a step's tiles computed side by side on single-threaded
lanes, against the plain computation, transformers, and the process's thread settings."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from tiny_deberta import V2_EMBEDDER, make_deberta
from tiny_encoders import make_mpnet
from tiny_models import MIN_COSINE, cosine, long_prompts

import pipepool
from pipepool.layers import cpu_lanes, cpu_tiles


@pytest.fixture
def two_threads():
    """Two intra-op threads (so two lanes) whatever the host, put back afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _threads_of_a_new_thread() -> int:
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    return seen[0]


def test_lanes_run_on_one_thread_each_and_leave_the_default_alone(two_threads):
    lanes = cpu_lanes.CpuLanes(2)
    assert lanes.map(lambda _: torch.get_num_threads(), range(6)) == [1] * 6
    assert torch.get_num_threads() == 2  # the creating thread's
    assert _threads_of_a_new_thread() == 2  # the process's default, as before the lanes


def test_lanes_answer_in_order_and_raise_what_an_item_raised(two_threads):
    lanes = cpu_lanes.CpuLanes(2)
    assert lanes.map(lambda i: i * i, list(range(10))) == [i * i for i in range(10)]

    def fail_on_three(i: int) -> int:
        if i == 3:
            raise ValueError("item 3")
        return i

    with pytest.raises(ValueError, match="item 3"):
        lanes.map(fail_on_three, range(5))
    assert lanes.map(lambda i: i + 1, [1, 2]) == [2, 3]  # the lanes still serve


def test_lanes_serve_calls_from_several_threads_at_once(two_threads):
    lanes = cpu_lanes.CpuLanes(2)
    answers: dict[int, list[int]] = {}

    def call(k: int) -> None:
        answers[k] = lanes.map(lambda i: i * k, list(range(50)))

    callers = [threading.Thread(target=call, args=(k,)) for k in range(1, 4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert answers == {k: [i * k for i in range(50)] for k in range(1, 4)}


def test_lanes_run_under_the_callers_inference_mode(two_threads):
    lanes = cpu_lanes.CpuLanes(2)
    with torch.inference_mode():
        assert lanes.map(lambda _: torch.is_inference_mode_enabled(), range(2)) == [True] * 2
    with torch.no_grad():
        assert lanes.map(lambda _: torch.is_grad_enabled(), range(2)) == [False] * 2
    assert lanes.map(lambda _: torch.is_inference_mode_enabled(), range(2)) == [False] * 2


def test_lanes_here_follows_the_threads_of_the_caller(two_threads):
    lanes = cpu_lanes.lanes_here()
    assert lanes is not None and lanes.size == 2
    assert cpu_lanes.lanes_here() is lanes  # one pool per process and size
    torch.set_num_threads(1)
    assert cpu_lanes.lanes_here() is None  # one thread: the caller's own


def test_tiles_come_in_multiples_of_the_lanes_where_each_gets_enough():
    lens = np.full(40, 30)  # 1,200 tokens
    cu = np.concatenate(([0], np.cumsum(lens)))
    assert len(cpu_tiles.plan_tiles(cu, tile_tokens=2048)) == 1
    assert len(cpu_tiles.plan_tiles(cu, tile_tokens=2048, lanes=2)) == 2
    assert len(cpu_tiles.plan_tiles(cu, tile_tokens=500, lanes=2)) == 4  # 3 spans, rounded up
    small = cu[: cpu_tiles.MIN_LANE_TOKENS // 30 + 1]  # under 2 x MIN_LANE_TOKENS tokens
    assert len(cpu_tiles.plan_tiles(small, tile_tokens=2048, lanes=2)) == 1


@pytest.fixture(scope="module")
def relative_paths(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lanes")
    return {
        "mpnet": make_mpnet(root / "mpnet"),
        "deberta": make_deberta(root / "deberta", **V2_EMBEDDER),
    }


@pytest.mark.parametrize("family", ["bert", "mpnet", "deberta"])
def test_encoder_steps_on_lanes_match_transformers(
    family, bert_path, relative_paths, reference, monkeypatch, two_threads
):
    # Every layer of every tile runs on a lane; per-token vectors ("all") would catch a row
    # written to the wrong place or a tile computed twice.
    path = bert_path if family == "bert" else relative_paths[family]
    maps = []
    real_map = cpu_lanes.CpuLanes.map
    monkeypatch.setattr(
        cpu_lanes.CpuLanes,
        "map",
        lambda self, fn, items: maps.append(len(items)) or real_map(self, fn, items),
    )
    ref = reference(path)
    prompts = long_prompts() * 4  # over 2 x MIN_LANE_TOKENS tokens a step
    with pipepool.Engine(str(path), max_num_batched_tokens=8192) as engine:
        outs = engine.pool(prompts, pooling="all", normalize=False)
    assert maps and min(maps) >= 2  # the steps ran on the lanes
    expected = {text: ref.pooled(ref.token_ids(text), "all") for text in set(prompts)}
    for text, out in zip(prompts, outs, strict=True):
        assert cosine(out, expected[text]).min() >= MIN_COSINE
