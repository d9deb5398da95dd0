"""Issue 37 item 5: connection hygiene, over raw sockets. A real ``pipepool serve`` (tiny BERT)
with short limits: a request's headers trickled slower than --header-timeout are answered 408
and the connection closed, as is a connection that sends nothing; a body that stalls, or
trickles a byte at a time, is answered 408 within --body-timeout; a keep-alive client pausing
between requests longer than the header timeout is not disturbed; a client address holds at
most --max-connections-per-client connections, the one over it answered 429 and closed, and
what was turned away is counted in /metrics. The same rules over uvicorn's h11 protocol, on a
bare app in this process."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import uvicorn
from test_server import ServerProcess, _free_port, wait_for

from pipepool.server.connections import MAX_HEADER_BYTES, ConnectionGuard, guarded_protocol
from pipepool.server.metrics import ConnectionCounts

# Slow: real `pipepool serve` processes held by slow clients until their timeouts.
pytestmark = pytest.mark.slow

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
PER_CLIENT = 4
# Each closing is waited for; a server that never closes fails the test after this long.
PATIENCE_S = 30.0


@pytest.fixture(scope="module")
def server(bert_path, tmp_path_factory):
    args = [
        "--model", str(bert_path),
        "--header-timeout", str(HEADER_TIMEOUT_S),
        "--body-timeout", str(BODY_TIMEOUT_S),
        "--max-connections-per-client", str(PER_CLIENT),
        "--no-access-log",
    ]  # fmt: skip
    s = ServerProcess(args, tmp_path_factory.mktemp("connections-log") / "server.log")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


# -- raw HTTP ---------------------------------------------------------------------------------


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=PATIENCE_S)


def request(path: str = "/health", body: bytes | None = None) -> bytes:
    if body is None:
        return f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode()
    head = f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
    return head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response (status, lower-case headers, body), by its Content-Length; not a byte
    of the next one (pipelined responses may arrive together)."""
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        byte = sock.recv(1)
        assert byte, f"the connection closed before a response: {head!r}"
        head += byte
    status_line, *lines = head.decode("latin-1").strip().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines)}
    body = b""
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(int(headers["content-length"]) - len(body))
        assert chunk, "the connection closed in the middle of a response"
        body += chunk
    return int(status_line.split()[1]), headers, body


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass  # closed with bytes of ours unread: what it sent before may be lost
    return data


def error_of(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def trickle(sock: socket.socket, data: bytes, gap_s: float) -> float:
    """Send ``data`` a byte every ``gap_s`` until the server answers or closes; the seconds
    from the first byte to then. Fails if all of it could be sent."""
    started = time.monotonic()
    for byte in data:
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - started
        if select.select([sock], [], [], gap_s)[0]:  # readable: an answer, or the close
            return time.monotonic() - started
    pytest.fail("the server let a trickled request through")


# -- headers ----------------------------------------------------------------------------------


def test_headers_trickled_slower_than_the_header_timeout_are_answered_408_and_closed(server):
    head = b"GET /health HTTP/1.1\r\nHost: test\r\nUser-Agent: slowloris\r\n\r\n"
    with connect(server.port) as sock:
        # 0.2 s a byte: the whole header would take 12 s.
        waited = trickle(sock, head, gap_s=0.2)
        status, err = error_of(read_until_closed(sock))
    assert status == 408 and err["code"] == "request_timeout", err
    assert "--header-timeout" in err["message"]
    assert HEADER_TIMEOUT_S - 0.3 < waited < len(head) * 0.2 / 2


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(server):
    with connect(server.port) as sock:
        opened = time.monotonic()
        status, _ = error_of(read_until_closed(sock))
        waited = time.monotonic() - opened
    assert status == 408
    assert waited > HEADER_TIMEOUT_S - 0.3


def test_headers_larger_than_the_bound_are_refused(server):
    with connect(server.port) as sock:
        huge = b"X-Padding: " + b"a" * 1000 + b"\r\n"
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n")
            for _ in range(MAX_HEADER_BYTES // len(huge) + 2):
                sock.sendall(huge)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = read_until_closed(sock)
    assert answer == b"" or answer.startswith(b"HTTP/1.1 400"), answer[:100]


# -- bodies -----------------------------------------------------------------------------------


def test_a_body_that_stalls_is_answered_408_and_closed(server):
    body = json.dumps({"input": "a stalled body"}).encode()
    with connect(server.port) as sock:
        sock.sendall(request("/v1/embeddings", body)[:-5])  # the last 5 bytes never come
        sent = time.monotonic()
        status, err = error_of(read_until_closed(sock))
        waited = time.monotonic() - sent
    assert status == 408 and err["code"] == "request_timeout", err
    assert "--body-timeout" in err["message"]
    assert waited > BODY_TIMEOUT_S - 0.3


def test_a_body_trickled_a_byte_at_a_time_is_answered_408(server):
    """Each byte comes well within the body timeout; the body as a whole does not."""
    body = json.dumps({"input": "x" * 200}).encode()
    whole = request("/v1/embeddings", body)
    head_size = whole.index(b"\r\n\r\n") + 4
    with connect(server.port) as sock:
        sock.sendall(whole[:head_size])
        waited = trickle(sock, body, gap_s=0.3)  # 64 s for all of it
        status, err = error_of(read_until_closed(sock))
    assert status == 408 and err["code"] == "request_timeout", err
    assert waited < len(body) * 0.3 / 2


# -- healthy clients --------------------------------------------------------------------------


def test_a_keep_alive_client_pausing_between_requests_is_not_disturbed(server):
    """Pauses longer than the header timeout, shorter than keep-alive: one connection serves
    every request (the header deadline starts with a request's first byte)."""
    body = json.dumps({"input": "kept alive"}).encode()
    with connect(server.port) as sock:
        for i in range(3):
            sock.sendall(request("/v1/embeddings", body) if i % 2 else request("/health"))
            status, headers, _ = read_response(sock)
            assert status == 200 and headers.get("connection") != "close", (i, headers)
            # Nothing but a close could come: wait that long for it not to.
            assert not select.select([sock], [], [], HEADER_TIMEOUT_S + 0.5)[0], i


# -- connections per client address -----------------------------------------------------------


def test_a_client_address_holds_at_most_the_configured_connections(server):
    # Connections of the tests above may still be closing on the server's side.
    wait_for(
        lambda: server.metrics()["pipepool_http_connections_open"] == 1,  # the one asking
        PATIENCE_S,
        "the other tests' connections to close",
    )
    held = [connect(server.port) for _ in range(PER_CLIENT)]
    try:
        for sock in held:  # each answered: the server has seen each of them
            sock.sendall(request())
            assert read_response(sock)[0] == 200
        with connect(server.port) as extra:
            answer = read_until_closed(extra)
        # 429 written before the close; a client may see only the close.
        if answer:
            status, err = error_of(answer)
            assert status == 429 and err["code"] == "too_many_connections", err
        for sock in held:  # still usable
            sock.sendall(request())
            assert read_response(sock)[0] == 200
        held.pop().close()
        wait_for(lambda: _answered(server.port), PATIENCE_S, "a connection once one closed")
    finally:
        for sock in held:
            sock.close()
    wait_for(
        lambda: server.metrics()["pipepool_http_connections_open"] == 1,
        PATIENCE_S,
        "every connection to close",
    )
    m = server.metrics()
    assert m["pipepool_http_connections_refused_total"] >= 1
    assert m["pipepool_http_header_timeouts_total"] >= 2
    assert m['pipepool_http_errors_total{type="invalid_request_error",code="request_timeout"}'] >= 2
    assert m['pipepool_http_requests_total{route="/v1/embeddings",status="408"}'] >= 2


def _answered(port: int) -> bool:
    with connect(port) as sock:
        sock.sendall(request())
        try:
            return read_response(sock)[0] == 200
        except AssertionError:  # refused: closed before a response
            return False


# -- the same rules over h11 ------------------------------------------------------------------


@contextmanager
def bare_server(http: str, slow_s: float = 0.0) -> Iterator[SimpleNamespace]:
    """uvicorn serving a bare app (200 "ok"; ``slow_s`` late on /slow, ``slow_started`` set
    then) through ``guarded_protocol(..., http)``, on a free port (``port``, ``guard``)."""
    slow_started = threading.Event()

    async def app(scope, receive, send) -> None:
        assert scope["type"] == "http"
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/slow":
            slow_started.set()
            await asyncio.sleep(slow_s)
        headers = [(b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})

    guard = ConnectionGuard(
        max_per_client=PER_CLIENT, header_timeout_s=HEADER_TIMEOUT_S, counts=ConnectionCounts()
    )
    port = _free_port()
    protocol = guarded_protocol(guard, http)
    config = uvicorn.Config(app, port=port, http=protocol, lifespan="off", log_config=None)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"bare-{http}")
    thread.start()
    try:
        wait_for(lambda: server.started, PATIENCE_S, "the bare server to start")
        yield SimpleNamespace(port=port, guard=guard, slow_started=slow_started)
    finally:
        server.should_exit = True
        thread.join()


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_each_protocol_keeps_the_header_deadline_and_the_cap(http):
    with bare_server(http) as bare:
        port = bare.port
        with connect(port) as sock:  # trickled headers: 408
            waited = trickle(sock, request(), gap_s=0.2)
            assert read_until_closed(sock).startswith(b"HTTP/1.1 408")
            assert waited > HEADER_TIMEOUT_S - 0.3
        with connect(port) as sock:  # pauses between requests: served on
            for _ in range(2):
                sock.sendall(request())
                assert read_response(sock)[0] == 200
                assert not select.select([sock], [], [], HEADER_TIMEOUT_S + 0.5)[0]
        held = [connect(port) for _ in range(PER_CLIENT)]
        try:
            for sock in held:
                sock.sendall(request())
                assert read_response(sock)[0] == 200
            with connect(port) as extra:
                answer = read_until_closed(extra)
            assert answer == b"" or answer.startswith(b"HTTP/1.1 429"), answer[:100]
        finally:
            for sock in held:
                sock.close()
        wait_for(lambda: _answered(port), PATIENCE_S, "a connection once the others closed")


def test_a_pipelined_request_waiting_behind_a_slow_one_is_not_timed_out():
    """A request answered slowly, then two more sent at once, the last one's headers cut in
    two: uvicorn stops reading after the second until the first is answered, which takes
    longer than the header timeout. That wait is the server's, not the client's: all three
    are answered."""
    with bare_server("httptools", slow_s=HEADER_TIMEOUT_S * 2) as bare:
        with connect(bare.port) as sock:
            sock.sendall(request("/slow"))
            wait_for(bare.slow_started.is_set, PATIENCE_S, "the slow request to start")
            third = request()
            sock.sendall(request() + third[:10])
            time.sleep(0.1)  # the rest comes in a read of its own
            sock.sendall(third[10:])
            assert [read_response(sock)[0] for _ in range(3)] == [200, 200, 200]
        assert bare.guard.counts.header_timeouts == 0
