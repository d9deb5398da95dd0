"""A route's answer, serialised where it costs the event loop least: on the loop itself when
small, else on a tokenising lane (``AsyncEngine.offload``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request, Response

from .. import lock_blocks
from ..encoding import Vectors, Wire, binary_response, values_in
from .shared import model_of


class PartsResponse(Response):
    """A response whose body is ``parts`` back to back (``Content-Length`` their total), sent
    a part per ASGI body message: a large answer is never copied into one buffer
    (``lock_blocks``)."""

    def __init__(self, parts: list[bytes], media_type: str) -> None:
        self.parts = parts
        super().__init__(b"", media_type=media_type)
        self.headers["content-length"] = str(sum(map(len, parts)))

    async def __call__(self, scope, receive, send) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        await send({**start, "headers": self.raw_headers})
        last = len(self.parts) - 1
        for i, part in enumerate(self.parts):
            await send({"type": "http.response.body", "body": part, "more_body": i < last})


async def json_answer(request: Request, build: Callable[[], Any], size: int = 0) -> Response:
    """The JSON answer ``build()`` returns, built and serialised on a tokenising lane
    (``AsyncEngine.offload``; ``size``: its numbers and characters, which pick the lane):
    thousands of numbers, or the documents a reranking quotes back, take milliseconds to
    encode, which every other request, of every model, would wait for on the event loop. A
    large one in parts (``lock_blocks``)."""
    parts = await model_of(request).front.offload(lambda: lock_blocks.dumps(build()), size=size)
    if len(parts) == 1:
        return Response(parts[0], media_type="application/json")
    return PartsResponse(parts, media_type="application/json")


async def binary_answer(
    request: Request, outputs: Vectors, wire: Wire, head: dict, num_tokens: list[int]
) -> Response:
    """vLLM's binary answer of ``outputs`` (``encoding.binary_response``), built on a
    tokenising lane as ``json_answer`` builds JSON."""
    size = values_in(outputs)
    return await model_of(request).front.offload(
        lambda: binary_response(outputs, wire, head, num_tokens), size=size
    )
