"""Light clients beside hostile ones on a real server (the bundled MiniLM, CPU): a one-word
request is answered while another client's large request is still in progress, whether that
one is 2,048 texts to embed or thousands of texts for TEI's ``/tokenize``; and the large
``/tokenize`` answer, written a piece at a time, is the same as its texts' answers one by one."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from test_server import ServerProcess, wait_for

LIGHT = {"input": "hello"}
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven"]


def text(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(seed + i) % len(WORDS)] for i in range(n_words))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess([], tmp_path_factory.mktemp("fair-server") / "server.log")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def client(server: ServerProcess, address: str) -> httpx.AsyncClient:
    """A client of its own loopback address: the server takes turns per client address."""
    transport = httpx.AsyncHTTPTransport(local_address=address)
    return httpx.AsyncClient(base_url=server.url, timeout=300, transport=transport)


async def in_flight(server: ServerProcess, name: str, at_least: float) -> None:
    """Until the server's gauge ``name`` (any labels) reaches ``at_least``: the large request
    is in."""

    async def reached() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            while True:
                for line in (await c.get("/metrics")).text.splitlines():
                    ours = line.startswith((name + " ", name + "{"))
                    if ours and float(line.rsplit(" ", 1)[1]) >= at_least:
                        return
                await asyncio.sleep(0.01)

    await asyncio.wait_for(reached(), 120)


def gauge(server: ServerProcess, name: str) -> float:
    """The gauge ``name`` of the server's one model."""
    (value,) = [v for k, v in server.metrics().items() if k.split("{")[0] == name]
    return value


def test_a_light_request_is_answered_while_another_clients_2048_texts_run(server):
    big = {"input": [text(20, i) for i in range(2048)]}

    async def scenario() -> None:
        async with client(server, "127.0.0.2") as heavy, client(server, "127.0.0.3") as light:
            large = asyncio.create_task(heavy.post("/v1/embeddings", json=big))
            await in_flight(server, "pipepool_server_pending_inputs", 2048)  # all its inputs
            r = await light.post("/v1/embeddings", json=LIGHT)
            assert r.status_code == 200 and len(r.json()["data"]) == 1
            assert not large.done(), "answered while the large request was in progress"
            large.cancel()  # the client leaves; the server drops the rest of its work
            await asyncio.gather(large, return_exceptions=True)

    asyncio.run(scenario())
    wait_for(lambda: gauge(server, "pipepool_running_requests") == 0, 120, "the engine idle")


def test_a_light_request_is_answered_while_a_large_tokenize_is_written(server):
    texts = [text(1 + i % 7, i) for i in range(2048)] * 10  # 20,480 texts in 2,048-text lists
    many = [texts[i : i + 2048] for i in range(0, len(texts), 2048)]

    async def scenario() -> list:
        async with client(server, "127.0.0.4") as heavy, client(server, "127.0.0.5") as light:
            large = [asyncio.create_task(heavy.post("/tokenize", json={"inputs": m})) for m in many]
            await in_flight(server, "pipepool_http_requests_in_flight", 3)  # two, and /metrics
            r = await light.post("/v1/embeddings", json=LIGHT)
            assert r.status_code == 200
            assert not all(task.done() for task in large)
            return [(await task).json() for task in large]

    answers = asyncio.run(scenario())
    assert [len(a) for a in answers] == [2048] * len(many)
    # Written a piece at a time, the answer is what each text alone gets.
    for i in (0, 1, 777, 2047):
        one = httpx.post(server.url + "/tokenize", json={"inputs": many[0][i]}, timeout=60)
        assert answers[0][i] == one.json()[0]
        assert answers[-1][i] == answers[0][i]
