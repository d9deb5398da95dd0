"""``pipepool.core.priority``: calls made inside ``background_work()`` queue below online calls
on every pipeline kind, and compute the same vectors; calls made inside ``client_turns(key)``
share their client's turn, so a client with many calls in flight does not take the turns of
one with few; the server keys turns by client address."""

from __future__ import annotations

import pytest
from tiny_models import MIN_COSINE, cosine

import pipepool
from pipepool.core.priority import (
    background_work,
    client_turns,
    current_client,
    is_background,
    turn_of,
)

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


def test_client_turns_are_scoped_and_stable():
    assert current_client() is None
    with client_turns("a"):
        assert current_client() == "a"
        with client_turns(None):
            assert current_client() is None
    assert current_client() is None
    assert turn_of("a") == turn_of("a") < 0
    assert turn_of("a") != turn_of("b")
    assert turn_of("\ud800") < 0  # any text a client key may hold


def test_a_client_with_many_calls_does_not_take_the_turns_of_one_with_few(engine):
    texts = TEXTS[:40]
    with client_turns("many"):
        many = [engine.submit(texts) for _ in range(6)]
    with client_turns("few"):
        few = engine.submit(texts)
    few.result(timeout=300)
    # Half the steps were "few"'s: its one call ended while most of "many"'s were under way
    # (taking turns call by call, it would have had a seventh of them and ended about last).
    unfinished = sum(not call.done() for call in many)
    assert unfinished >= 3, unfinished
    expected = engine.embed(texts)
    for call in [*many, few]:
        assert cosine(call.result(timeout=300), expected).min() >= MIN_COSINE


def test_the_server_takes_turns_by_client_address():
    import asyncio

    from pipepool.server.front_door import FrontDoor
    from pipepool.server.metrics import HttpMetrics
    from pipepool.server.settings import ServerSettings

    seen = []

    async def app(scope, receive, send) -> None:
        seen.append(current_client())

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def call(client) -> None:
        door = FrontDoor(app, settings=ServerSettings(), metrics=HttpMetrics(frozenset()))
        scope = {"type": "http", "client": client, "method": "GET", "path": "/", "headers": []}
        await door(scope, receive, None)

    asyncio.run(call(("10.0.0.7", 5555)))
    asyncio.run(call(("10.0.0.7", 6666)))
    asyncio.run(call(None))
    assert seen == ["address:10.0.0.7", "address:10.0.0.7", None]
