"""Issue 5 acceptance: every limit and bad input gets the right status and an OpenAI-style
error body, and the server keeps serving afterwards. One server with an API key and small
limits, PP=2 with stage restarts off so that the last test can kill a stage for good."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
from test_server import ServerProcess, _alive, assert_close, assert_kv_blocks_all_free, wait_for
from tiny_models import SENTENCES, long_prompts

import pipepool
from pipepool.server.errors import RETRY_AFTER_MS

# Slow: real `pipepool serve` processes at PP=2, queues filled.
pytestmark = pytest.mark.slow

KEY = "s3cret-key"
MODEL = "tiny"
MAX_INPUTS = 4
MAX_QUEUED = 6
QUEUE_WAIT_S = 0.5
MAX_LEN = 128
MAX_BODY = 16384
KEEP_ALIVE_S = 2
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(qwen3_path, tmp_path_factory):
    args = ["--model", str(qwen3_path), "--served-model-name", MODEL, "--pp", "2"]
    args += ["--allow-token-ids"]
    args += ["--api-key", KEY, "--max-inputs-per-request", str(MAX_INPUTS)]
    args += ["--max-queued-requests", str(MAX_QUEUED), "--max-body-bytes", str(MAX_BODY)]
    args += ["--queue-wait", str(QUEUE_WAIT_S)]
    # A tiny step budget makes a request of long prompts slow enough to fill the queue.
    args += ["--max-model-len", str(MAX_LEN), "--max-num-batched-tokens", "2"]
    args += ["--stage-restarts", "0", "--timeout-keep-alive", str(KEEP_ALIVE_S)]
    s = ServerProcess(args, tmp_path_factory.mktemp("limits-log") / "server.log")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def engine(qwen3_path):
    with pipepool.Engine(str(qwen3_path), max_model_len=MAX_LEN) as e:
        yield e


def post(server, path: str = "/v1/embeddings", headers=AUTH, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, headers=headers, timeout=30, **kwargs)


def assert_error(r: httpx.Response, status: int, type: str, code=None, param=None, says=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert err["type"] == type, err
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    if says is not None:
        assert says in err["message"], err
    return err


def test_health_is_503_while_the_model_loads(server):
    # The server listens at once; loading two stages takes seconds, so the first polls of
    # the fixture saw the engine loading.
    assert server.health_seen == [(503, {"status": "loading"}), (200, {"status": "ok"})]


# -- authentication -------------------------------------------------------------------------


def test_api_key_is_required_on_api_routes(server):
    body = {"input": "hi"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for path in ("/v1/embeddings", "/pooling", "/tokenize"):
            r = post(server, path, headers=headers, json=body)
            assert_error(r, 401, "authentication_error", code="invalid_api_key")
    r = httpx.get(server.url + "/v1/models")
    assert_error(r, 401, "authentication_error")
    assert post(server, json=body).status_code == 200
    # Probes, scrapers and the docs stay open.
    for path in ("/health", "/metrics", "/docs"):
        assert httpx.get(server.url + path).status_code == 200, path


def test_openai_client_with_and_without_the_key(server, engine):
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    result = good.embeddings.create(model=MODEL, input=SENTENCES[:2])
    for d, e in zip(result.data, engine.embed(SENTENCES[:2]), strict=True):
        assert_close(d.embedding, e)
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.embeddings.create(model=MODEL, input="x")


# -- limits ---------------------------------------------------------------------------------


def test_too_many_inputs(server):
    r = post(server, json={"input": SENTENCES[: MAX_INPUTS + 1]})
    assert_error(r, 400, "invalid_request_error", "too_many_inputs", "input", f"{MAX_INPUTS}")
    assert post(server, json={"input": SENTENCES[:MAX_INPUTS]}).status_code == 200


def test_prompt_too_long_is_truncated_unless_told_to_refuse_it(server, engine):
    text = long_prompts()[3]  # ~600 tokens
    for path in ("/v1/embeddings", "/pooling"):
        r = post(server, path, json={"input": [SENTENCES[0], text], "long_inputs": "error"})
        err = assert_error(r, 400, "invalid_request_error", "context_length_exceeded", "input")
        assert f"max_model_len={MAX_LEN}" in err["message"] and "input 1" in err["message"]
    r = post(server, json={"input": text})  # the default, as in sentence-transformers and TEI
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == MAX_LEN
    assert_close(r.json()["data"][0]["embedding"], engine.embed([text])[0])
    for truncate in (MAX_LEN, -1, 10):
        r = post(server, json={"input": text, "truncate_prompt_tokens": truncate})
        assert r.status_code == 200, r.text
        expected_len = MAX_LEN if truncate == -1 else truncate
        assert r.json()["usage"]["prompt_tokens"] == expected_len
        expected = engine.embed([text], truncate_prompt_tokens=truncate)[0]
        assert_close(r.json()["data"][0]["embedding"], expected)
    r = post(server, json={"input": text, "truncate_prompt_tokens": MAX_LEN + 1})
    assert_error(r, 400, "invalid_request_error", param="truncate_prompt_tokens")


def test_body_too_large_by_content_length_and_while_reading(server):
    big = json.dumps({"input": ["x" * (MAX_BODY // 2)] * 3}).encode()
    r = post(server, content=big, headers={**AUTH, "Content-Type": "application/json"})
    assert_error(r, 413, "invalid_request_error", "request_too_large", says=str(MAX_BODY))

    def chunks():  # chunked transfer encoding: no Content-Length to check up front
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    r = post(server, content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_error(r, 413, "invalid_request_error", "request_too_large")
    assert post(server, json={"input": "still here"}).status_code == 200


def test_queue_full_is_429(server):
    # Four long inputs at 2 tokens per step keep the engine busy for a while; the server
    # admits at most MAX_QUEUED inputs at once, so three more do not fit meanwhile.
    slow = {"input": [f"{i} {long_prompts()[3]}" for i in range(4)], "truncate_prompt_tokens": 128}
    first = {}
    t = threading.Thread(target=lambda: first.update(r=post(server, json=slow)))
    t.start()
    wait_for(lambda: server.metrics()["pipepool_server_pending_inputs"] == 4, what="queued")
    sent = time.monotonic()
    r = post(server, json={"input": SENTENCES[:3]})
    # Refused after waiting --queue-wait for room the slow request never left.
    assert time.monotonic() - sent >= QUEUE_WAIT_S and "r" not in first
    err = assert_error(r, 429, "rate_limit_error", "queue_full")
    assert r.headers["retry-after"] == "1"
    # Spread around the second, so that clients refused together do not retry together.
    low, high = RETRY_AFTER_MS
    assert low <= int(r.headers["retry-after-ms"]) <= high
    assert str(MAX_QUEUED) in err["message"] and f"waited {QUEUE_WAIT_S:g} s" in err["message"]
    assert post(server, json={"input": SENTENCES[:2]}).status_code == 200  # 4 + 2 fit
    t.join()
    assert first["r"].status_code == 200
    m = server.metrics()
    assert m['pipepool_http_errors_total{type="rate_limit_error",code="queue_full"}'] >= 1


# -- bad input ------------------------------------------------------------------------------

BAD_EMBEDDING_BODIES = {
    "no input": ({"model": MODEL}, "input"),
    "input a number": ({"input": 5}, "input"),
    "strings and ids mixed": ({"input": ["a", 1]}, "input"),
    "nested too deep": ({"input": [[[1, 2]]]}, "input"),
    "bool token": ({"input": [True, 2]}, "input"),
    "empty list": ({"input": []}, "input"),
    "empty string": ({"input": ["ok", ""]}, "input"),
    "empty token list": ({"input": [[1], []]}, "input"),
    "token id beyond vocab": ({"input": [[1, 10**6]]}, "input"),
    "negative token id": ({"input": [-1, 2]}, "input"),
    "bad encoding_format": ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    "dimensions zero": ({"input": "a", "dimensions": 0}, "dimensions"),
    "dimensions too large": ({"input": "a", "dimensions": 65}, "dimensions"),
    "dimensions a string": ({"input": "a", "dimensions": "8"}, "dimensions"),
    "truncate zero": ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    "unknown long_inputs": ({"input": "a", "long_inputs": "split"}, "long_inputs"),
    "body not an object": ([1, 2], None),
}


@pytest.mark.parametrize("case", BAD_EMBEDDING_BODIES)
def test_bad_embedding_requests_are_400(server, case):
    body, param = BAD_EMBEDDING_BODIES[case]
    r = post(server, json=body)
    assert_error(r, 400, "invalid_request_error", param=param)


def test_malformed_json_and_wrong_routes(server):
    r = post(server, content=b'{"input": [', headers={**AUTH, "Content-Type": "application/json"})
    assert_error(r, 400, "invalid_request_error", says="not valid JSON")
    r = post(server, content=b"", headers={**AUTH, "Content-Type": "application/json"})
    assert_error(r, 400, "invalid_request_error")
    r = httpx.get(server.url + "/v1/embeddings", headers=AUTH)
    assert_error(r, 405, "invalid_request_error", "method_not_allowed")
    r = httpx.get(server.url + "/v1/nothing", headers=AUTH)
    assert_error(r, 404, "not_found_error")


def test_unknown_model_is_404(server):
    for path, body in (
        ("/v1/embeddings", {"input": "a", "model": "gpt-4"}),
        ("/pooling", {"input": "a", "model": "gpt-4"}),
        ("/tokenize", {"prompt": "a", "model": "gpt-4"}),
    ):
        r = post(server, path, json=body)
        assert_error(r, 404, "invalid_request_error", "model_not_found", "model", "gpt-4")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="a")


def test_bad_tokenize_and_pooling_requests(server):
    for body in ({}, {"prompt": "a", "input": "b"}, {"prompt": 3}, {"prompt": "a", "inputs": "b"}):
        assert_error(post(server, "/tokenize", json=body), 400, "invalid_request_error")
    r = post(server, "/pooling", json={"input": "a", "normalize": "maybe"})
    assert_error(r, 400, "invalid_request_error", param="normalize")


def test_unknown_fields_are_refused_naming_each_as_openai_does(server):
    r = post(server, json={"input": "a", "temperature": 1})
    err = assert_error(r, 400, "invalid_request_error", param="temperature")
    assert err["message"] == "Unrecognized request argument supplied: temperature"
    r = post(server, json={"input": "a", "dimensions_x": 3, "extra_body": {"a": 1}})
    err = assert_error(r, 400, "invalid_request_error", param="dimensions_x")
    assert err["message"] == "Unrecognized request arguments supplied: dimensions_x, extra_body"
    r = post(server, "/pooling", json={"input": "a", "dimensions": 4})  # not a pooling field
    assert_error(r, 400, "invalid_request_error", param="dimensions", says="dimensions")


# Lone surrogates as JSON writes them ("\ud800" escapes): once a 500 whose error body could not
# be encoded, which broke the connection for the next request on it. Every route and field:
# test_server_hygiene.py.
SURROGATE_BODIES = [
    ("/v1/embeddings", r'{"input": ["fine", "bad \ud800 text"]}', 400, "input 1", "U+D800"),
    ("/pooling", r'{"input": "\udfff"}', 400, "input", "U+DFFF"),
    ("/tokenize", r'{"prompt": "x\ud800"}', 400, "prompt", "U+D800"),
    ("/v1/embeddings", r'{"input": "a", "model": "m\ud800"}', 400, "model", "U+D800"),
]


@pytest.mark.parametrize(("path", "body", "status", "names", "says"), SURROGATE_BODIES)
def test_lone_surrogate_is_a_4xx_and_the_connection_serves_the_next_request(
    server, path, body, status, names, says
):
    with httpx.Client(headers={**AUTH, "Content-Type": "application/json"}, timeout=30) as http:
        r = http.post(server.url + path, content=body.encode())
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert names in err["message"] + str(err["param"]) and says in err["message"], err
        assert r.headers.get("connection") != "close"
        again = http.post(server.url + "/v1/embeddings", json={"input": "fine"})
        assert again.status_code == 200, again.text
    assert "Traceback" not in server.log()


def test_json_sent_as_text_plain_is_400_saying_which_content_type(server):
    r = post(server, content=b'{"input": "a"}', headers={**AUTH, "Content-Type": "text/plain"})
    assert_error(r, 400, "invalid_request_error", "invalid_content_type", says="application/json")
    assert "text/plain" in r.json()["error"]["message"]


def test_idle_keep_alive_connection_closes_after_the_configured_timeout(server):
    """--timeout-keep-alive reaches uvicorn: an idle connection is closed after it, no sooner
    (its default of 5 s is shorter than many clients keep idle connections)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
        response = b""
        while b"\r\n\r\n" not in response or not response.endswith(b"}"):
            response += sock.recv(4096)
        assert response.startswith(b"HTTP/1.1 200")
        answered = time.monotonic()
        assert sock.recv(1) == b""  # blocks until the server closes the idle connection
        idle = time.monotonic() - answered
    assert KEEP_ALIVE_S - 0.5 < idle < KEEP_ALIVE_S + 5


def test_server_still_serves_after_all_that(server, engine):
    r = post(server, json={"input": SENTENCES[:MAX_INPUTS]})
    assert r.status_code == 200
    for d, e in zip(r.json()["data"], engine.embed(SENTENCES[:MAX_INPUTS]), strict=True):
        assert_close(d["embedding"], e)
    assert_kv_blocks_all_free(server)
    m = server.metrics()
    assert m['pipepool_http_requests_total{route="/v1/embeddings",status="400"}'] >= 10
    assert m['pipepool_http_errors_total{type="authentication_error",code="invalid_api_key"}'] >= 1


# -- a stage dies (last: it stops the server) ------------------------------------------------


def test_stage_death_without_restarts_fails_requests_503_and_the_server_exits_non_zero(server):
    """With --stage-restarts 0 a dead stage cannot be replaced: requests in flight get 503 and
    the server exits non-zero, so that an orchestrator restarts it (it used to answer 503
    forever and exit 0 on a later SIGTERM)."""
    slow = {"input": [f"{i} {long_prompts()[3]}" for i in range(4)], "truncate_prompt_tokens": 128}
    result = {}
    t = threading.Thread(target=lambda: result.update(r=post(server, json=slow)))
    t.start()
    wait_for(lambda: server.metrics()["pipepool_server_pending_inputs"] == 4, what="in flight")
    (stage,) = server.children()
    os.kill(stage[0], signal.SIGKILL)
    t.join()
    assert_error(result["r"], 503, "server_error", "engine_unavailable", says="stage 1")
    assert server.proc.wait(timeout=60) != 0
    log = server.log()
    assert "cannot recover" in log and "stage 1" in log
    assert not _alive(stage)


def test_large_requests_leave_the_last_part_of_the_queue_to_small_ones():
    from pipepool.server.front import SMALL_REQUEST_INPUTS, AsyncEngine, QueueFullError

    front = AsyncEngine(owner=None, max_queued=64)  # type: ignore[arg-type]  # no engine needed

    async def admissions() -> None:
        await front._admit(60)  # an empty queue takes any request the input limit lets through
        front.pending = 24
        large = SMALL_REQUEST_INPUTS + 1  # 24 + 33 fits 64, not 64 - 64 // 8
        with pytest.raises(QueueFullError, match="kept for small requests"):
            await front._admit(large)
        await front._admit(SMALL_REQUEST_INPUTS)  # 56
        await front._admit(8)  # 64: the queue is full for everyone
        with pytest.raises(QueueFullError) as full:
            await front._admit(1)
        assert "small requests" not in str(full.value) and "waited" not in str(full.value)

    try:
        asyncio.run(admissions())
    finally:
        front.close()


def test_a_request_that_finds_the_queue_full_waits_for_room_in_turn():
    """--queue-wait: a request that does not fit waits for room, admitted as answers free it
    (in arrival order, a smaller later one by a larger one that still does not fit), refused
    when the wait runs out; a client that leaves while waiting, or just as it was admitted,
    gives its place back."""
    from pipepool.server.front import AsyncEngine, QueueFullError

    front = AsyncEngine(owner=None, max_queued=8, queue_wait=30)  # type: ignore[arg-type]

    async def admissions() -> None:
        await front._admit(8)
        six = asyncio.create_task(front._admit(6))
        two = asyncio.create_task(front._admit(2))
        await asyncio.sleep(0)
        assert (front.pending, front.waiting) == (8, 8) and not six.done()
        front._free(4)  # 4 in progress: the six do not fit, the two do
        assert (front.pending, front.waiting) == (6, 6)
        await two
        assert not six.done()
        front._free(4)
        await six
        assert (front.pending, front.waiting) == (8, 0)

        leaving = asyncio.create_task(front._admit(3))
        await asyncio.sleep(0)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert (front.pending, front.waiting) == (8, 0)

        late = asyncio.create_task(front._admit(3))
        await asyncio.sleep(0)
        front._free(5)  # admits it (3 + 3)...
        late.cancel()  # ...and its client leaves before it runs on
        with pytest.raises(asyncio.CancelledError):
            await late
        assert (front.pending, front.waiting) == (3, 0)

        front.queue_wait = 0.05
        await front._admit(5)
        started = time.monotonic()
        with pytest.raises(QueueFullError, match=r"waited 0\.05 s for room"):
            await front._admit(1)
        assert time.monotonic() - started >= 0.05
        assert (front.pending, front.waiting) == (8, 0)

    try:
        asyncio.run(admissions())
    finally:
        front.close()
