"""A route's answer, serialised where it costs the event loop least: on the loop itself when
small, else on a tokenising lane (``AsyncEngine.offload``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request, Response

from ..encoding import Vectors, Wire, binary_response, json_bytes, values_in
from .shared import model_of


async def json_answer(request: Request, build: Callable[[], Any], size: int = 0) -> Response:
    """The JSON answer ``build()`` returns, built and serialised on a tokenising lane
    (``AsyncEngine.offload``; ``size``: its numbers and characters, which pick the lane):
    thousands of numbers, or the documents a reranking quotes back, take milliseconds to
    encode, which every other request, of every model, would wait for on the event loop."""
    text = await model_of(request).front.offload(lambda: json_bytes(build()), size=size)
    return Response(text, media_type="application/json")


async def binary_answer(
    request: Request, outputs: Vectors, wire: Wire, head: dict, num_tokens: list[int]
) -> Response:
    """vLLM's binary answer of ``outputs`` (``encoding.binary_response``), built on a
    tokenising lane as ``json_answer`` builds JSON."""
    size = values_in(outputs)
    return await model_of(request).front.offload(
        lambda: binary_response(outputs, wire, head, num_tokens), size=size
    )
