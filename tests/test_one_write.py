"""``one_write.hold_head``: uvicorn's own request cycle, writing through a recording transport,
sends an answer of known length as one write of head and body, and every other answer as
uvicorn writes it, the bytes unchanged."""

from __future__ import annotations

import asyncio
import logging

import pytest
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from pipepool.server.one_write import hold_head


class Recorder:
    """A transport that records each call that sends bytes, and its close."""

    def __init__(self) -> None:
        self.calls: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.calls.append(bytes(data))

    def writelines(self, parts) -> None:
        self.calls.append(b"".join(parts))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _cycle(method: str = "POST") -> tuple[RequestResponseCycle, Recorder]:
    transport = Recorder()
    scope = {"type": "http", "method": method, "path": "/", "headers": []}
    cycle = RequestResponseCycle(
        scope=scope,  # type: ignore[arg-type]
        transport=transport,  # type: ignore[arg-type]
        flow=FlowControl(transport),  # type: ignore[arg-type]
        logger=logging.getLogger("test"),
        access_logger=logging.getLogger("test.access"),
        access_log=False,
        default_headers=[],
        message_event=asyncio.Event(),
        expect_100_continue=False,
        keep_alive=True,
        on_response=lambda: None,
    )
    hold_head(cycle)
    hold_head(cycle)  # a second call wraps nothing twice
    return cycle, transport


def _start(length: int | None) -> dict:
    headers = [(b"content-type", b"application/json")]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    return {"type": "http.response.start", "status": 200, "headers": headers}


def test_known_length_is_one_write() -> None:
    async def main():
        cycle, transport = _cycle()
        await cycle.send(_start(7))
        assert transport.calls == []
        await cycle.send({"type": "http.response.body", "body": b'{"a":1}'})
        return transport

    transport = asyncio.run(main())
    assert len(transport.calls) == 1
    head, body = transport.calls[0].split(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and b"content-length: 7" in head
    assert body == b'{"a":1}'


def test_body_in_parts_keeps_its_order() -> None:
    async def main():
        cycle, transport = _cycle()
        await cycle.send(_start(6))
        for part, more in ((b"ab", True), (b"cd", True), (b"ef", False)):
            await cycle.send({"type": "http.response.body", "body": part, "more_body": more})
        return transport

    transport = asyncio.run(main())
    assert transport.calls[0].endswith(b"\r\n\r\nab") and transport.calls[1:] == [b"cd", b"ef"]


@pytest.mark.parametrize(("method", "length"), [("POST", None), ("HEAD", 7), ("POST", 0)])
def test_chunked_head_and_empty_answers_write_their_head_at_once(method, length) -> None:
    async def main():
        cycle, transport = _cycle(method)
        await cycle.send(_start(length))
        assert len(transport.calls) == 1 and transport.calls[0].endswith(b"\r\n\r\n")
        return transport

    asyncio.run(main())


def test_close_sends_a_held_head_first() -> None:
    async def main():
        cycle, transport = _cycle()
        await cycle.send(_start(7))
        cycle.transport.close()  # what uvicorn does when the app fails mid-answer
        return transport

    transport = asyncio.run(main())
    assert transport.closed and transport.calls[0].startswith(b"HTTP/1.1 200 OK")
