"""A ``/v1/embeddings`` request, from its body to its answer, in three steps that
``openai.embeddings`` takes in turn: ``prepare`` (on the event loop: the model chosen, every
check that a 4xx answers, the engine work within the server's limits; a chat form's remote
image fetched), the engine's run (``shared.run_engine``), then ``answer``. What the body asks
picks the work: the dense vectors (``limits.embedding_call``: ``Engine.submit``, tokenised
once and counted on those tokens), other outputs (``retrieval.outputs_call``), late chunking
(``late_chunking.late_chunks_call``), both calls that wait for their own results, counted once
done, each held to the server's limits by ``limits.embedding_call``; or vLLM's chat form
(``chat_embeddings.messages_call``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request, Response

from ...api.engine import Engine
from ...api.retrieval import RetrievalOutputs
from ...loading.retrieval import OUTPUTS
from .. import protocol
from ..encoding import values_in
from ..errors import APIError
from ..front import Encoded, EngineCall
from ..limits import embedding_call
from ..pooling_protocol import answer_head
from . import retrieval
from .answers import binary_answer, json_answer
from .chat_embeddings import messages_call
from .late_chunking import late_chunks_call
from .page_retrievers import refuse_page_retriever
from .shared import check_task, model_of, select_model, state_of

DENSE = ("dense",)


async def prepare(request: Request, body: protocol.EmbeddingRequest) -> EngineCall:
    """The engine work ``body`` asks of its model, every check made: 400 for options that do
    not go together, for outputs the model does not give, and for inputs over the limits; 404
    for a model that does not embed; 503 while it loads. ``messages`` (vLLM's chat form):
    one input (``chat_embeddings.py``), a remote image in it fetched here."""
    if body.late_chunking and body.outputs not in (None, list(DENSE)):
        raise APIError(
            400,
            "late_chunking gives dense vectors only: ask for sparse or multi_vector outputs "
            "without it",
            param="late_chunking",
            code="invalid_value",
        )
    asked = DENSE if body.outputs is None else body.outputs
    model = select_model(
        request, body.model, *(retrieval.task_of(o) for o in asked if o in OUTPUTS)
    )
    refuse_page_retriever(
        model,
        "/v1/embeddings answers one vector per input (or a text's sparse or multi-vector outputs)",
    )
    outputs = DENSE if body.outputs is None else retrieval.check_model_outputs(request, asked)
    if outputs != DENSE and body.wire.binary:
        raise APIError(
            400,
            f"encoding_format {body.encoding_format} carries dense vectors only; ask for "
            f"{', '.join(outputs)} with encoding_format float or base64",
            param="encoding_format",
            code="invalid_value",
        )
    if body.messages is not None and outputs == DENSE and not body.late_chunking:
        return await messages_call(
            request, body, dimensions=body.dimensions, normalize=body.normalized
        )
    # messages with outputs or late chunking: body.inputs() refuses them (no input)
    settings, inputs = state_of(request).settings, body.inputs()
    counted: Callable[[Engine], Any] | None = None
    if outputs != DENSE:
        counted = retrieval.outputs_call(body, inputs, outputs)
    elif body.late_chunking:
        counted = late_chunks_call(body, inputs)
    else:
        check_task(model, "embed")
    options = {
        "truncate_prompt_tokens": body.truncate_prompt_tokens,
        "truncation_side": body.truncation_side or "right",
        "long_inputs": body.long_inputs,
        "dimensions": body.dimensions,
        "normalize": body.normalized,
    }
    return embedding_call(
        settings,
        model.front,
        inputs,
        options,
        add_special_tokens=body.add_special_tokens,
        counted=counted,
    )


async def answer(
    request: Request, body: protocol.EmbeddingRequest, done: Encoded | RetrievalOutputs
) -> Response:
    """OpenAI's answer of ``done`` (what ``prepare``'s work gave), in the body's
    ``encoding_format``: vLLM's binary answer for ``bytes`` and ``bytes_only``."""
    name, wire = model_of(request).names.response_name(body.model), body.wire
    if isinstance(done, RetrievalOutputs):
        size = retrieval.outputs_size(done)
        return await json_answer(request, lambda: protocol.outputs_response(name, done, wire), size)
    if wire.binary:
        head = {**answer_head("embd"), "model": name}
        return await binary_answer(request, done.outputs, wire, head, done.num_tokens)
    return await json_answer(
        request,
        lambda: protocol.embedding_response(name, done.outputs, done.num_tokens, wire),
        values_in(done.outputs),
    )
