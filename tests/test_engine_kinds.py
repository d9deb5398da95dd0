"""What every Engine promises whatever pipeline it runs on (in-process, stage processes,
replicas; conftest.ENGINE_KINDS): chunked prompts equal to transformers, a cancelled call
counted once, a trace of every process, health, death callbacks and close."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tiny_models import MIN_COSINE, cosine

import pipepool
from pipepool.errors import EngineDeadError

BUDGET = 16  # under every prompt below: each is planned in several chunks


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 200, size=k).tolist() for k in rng.integers(20, 120, size=n)]


@pytest.fixture(scope="module")
def engine(qwen3_path, engine_kind, tmp_path_factory):
    trace = tmp_path_factory.mktemp("kinds") / "trace.json"
    engine = pipepool.Engine(
        str(qwen3_path), max_num_batched_tokens=BUDGET, trace=str(trace), **engine_kind
    )
    yield engine
    engine.close(write_trace=False)


def test_chunked_prompts_match_transformers_per_request(engine, reference, qwen3_path):
    prompts = _prompts(12)
    assert max(map(len, prompts)) > BUDGET
    ours = engine.pool(prompts, pooling="last", normalize=False)
    ref = reference(qwen3_path)
    for p, v in zip(prompts, ours, strict=True):
        assert cosine(v, ref.pooled(p, "last")) >= MIN_COSINE


def test_a_cancelled_call_counts_each_request_finished_or_aborted_once(engine):
    before = engine.stats
    future = engine.submit(_prompts(400, seed=1), pooling="mean")
    future.cancel()
    engine.embed(_prompts(3, seed=2))  # the engine serves on; the cancelled call's rows settle
    after = engine.stats
    submitted = after.requests_submitted - before.requests_submitted
    settled = (after.requests_finished - before.requests_finished) + (
        after.requests_aborted - before.requests_aborted
    )
    assert submitted == 403
    assert settled == submitted


def test_write_trace_holds_every_process_and_a_summary_per_stage(engine, engine_kind, tmp_path):
    engine.pool(_prompts(6, seed=3), pooling="mean")
    path = tmp_path / "t.json"
    summary = engine.write_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    processes = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    forwards = [e for e in events if e["ph"] == "X" and e["name"] == "forward"]
    replicas = engine_kind.get("data_parallel_size", 1)
    stages = engine_kind.get("pipeline_parallel_size", 1)
    assert len(summary.stages) == replicas * stages
    assert len(processes) == replicas * (1 + stages)  # a driver and its stages, per pipeline
    assert forwards and summary.seconds > 0


def test_health_death_callbacks_and_close(qwen3_path, engine_kind):
    engine = pipepool.Engine(str(qwen3_path), max_num_batched_tokens=BUDGET, **engine_kind)
    deaths: list[BaseException] = []
    engine.pipeline.add_death_callback(deaths.append)
    assert engine.health == "ok"
    assert engine.embed(["a sentence"]).shape == (1, engine.info.dimensions)
    engine.close()
    engine.close()  # twice is fine
    assert engine.health == "closed"
    assert deaths == []  # close() is not a death
    with pytest.raises(EngineDeadError):
        engine.embed(["after close"])
