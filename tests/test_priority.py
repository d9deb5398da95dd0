"""Background work (``pipepool.api.priority``): calls made inside ``background_work()`` queue
below online calls on every pipeline kind, and compute the same vectors."""

from __future__ import annotations

import pytest
from tiny_models import MIN_COSINE, cosine

import pipepool
from pipepool.api.priority import background_work, is_background

TEXTS = [f"document {i}: " + "words of a background job " * (1 + i % 7) for i in range(240)]
ONLINE = ["a short online query", "another one"]


@pytest.fixture(scope="module")
def engine(engine_kind, qwen3_path):
    with pipepool.Engine(
        str(qwen3_path), max_num_batched_tokens=64, dtype="float32", **engine_kind
    ) as engine:
        yield engine


def test_background_work_is_scoped_to_its_context():
    assert not is_background()
    with background_work():
        assert is_background()
    assert not is_background()


def test_an_online_call_overtakes_a_background_job_and_both_are_right(engine):
    with background_work():
        job = engine.submit(TEXTS)
    online = engine.submit(ONLINE)
    online_vectors = online.result(timeout=120)
    # The job had all its inputs queued before the online call came, and many steps of
    # work left: the online call went first.
    assert job.num_done < job.num_inputs
    job_vectors = job.result(timeout=300)
    assert cosine(job_vectors, engine.embed(TEXTS)).min() >= MIN_COSINE
    assert cosine(online_vectors, engine.embed(ONLINE)).min() >= MIN_COSINE
    # What the scheduler is told (its policy: tests/test_scheduler.py).
    assert job.background and all(batch.background for batch in job.batches)
    assert not online.background and not any(batch.background for batch in online.batches)
