"""Cohere v2's ``POST /v2/embed``, so Cohere's client (``cohere.ClientV2.embed``) works as it
is: each text's embedding in every type asked for, quantized as sentence-transformers'
``quantize_embeddings`` does (``api/quantization.py``, as ``Engine.encode`` does). The same
limits, errors, metrics and API key as ``/v1/embeddings`` (Cohere's rerank is in
``scoring.py``)."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Request, Response

from ...api.engine import Engine
from ...api.st_compat import task_prompt_name
from ...errors import EngineDeadError, InvalidInputError
from .. import cohere_protocol as cp
from ..errors import APIError, from_engine
from .shared import ERRORS, json_answer, run_model_outputs, select_model

router = APIRouter(tags=["Cohere"])


@router.post("/v2/embed", response_model=cp.CohereEmbedResponse, responses=ERRORS)
async def embed(body: cp.CohereEmbedRequest, request: Request) -> Response:
    """Each text's embedding in every type of ``embedding_types``, in text order."""
    model = select_model(request, body.model, "embed")
    try:
        engine = model.front.engine
    except EngineDeadError as exc:  # loading, or failed to start: 503
        raise from_engine(exc) from None
    prompt_name = _prompt_name(engine, body.input_type)
    done = await run_model_outputs(
        request,
        body.texts,
        param="texts",
        dimensions=body.output_dimension,
        prompt_name=prompt_name,
        **_truncation(engine, body, prompt_name),
    )
    if isinstance(done, Response):
        return done
    if body.truncate == "NONE" and body.max_tokens is not None:
        _refuse_over(done.num_tokens, body.max_tokens)
    vectors = np.stack(done.outputs)  # [n, dim]
    try:
        return await json_answer(
            request,
            lambda: cp.embed_response(
                body.texts, vectors, body.embedding_types, done.num_tokens, body.ranges
            ),
            vectors.size * len(body.embedding_types),
        )
    except InvalidInputError as exc:  # ranges that do not fit the vectors
        raise from_engine(exc) from None


def _prompt_name(engine: Engine, input_type: str) -> str | None:
    """The model's prompt for Cohere's ``input_type``: its query and document prompts as
    ``encode_query`` and ``encode_document`` pick them, else one named as the input type (for
    classification and clustering); None: the model's default prompt, if any."""
    prompts = engine.inputs.prompts
    if input_type == "search_query":
        return task_prompt_name(prompts, "query")
    if input_type == "search_document":
        return task_prompt_name(prompts, "document")
    return input_type if input_type in prompts else None


def _truncation(engine: Engine, body: cp.CohereEmbedRequest, prompt_name: str | None) -> dict:
    """The engine's options for Cohere's ``truncate`` and ``max_tokens``. START cuts tokens
    from the start of the prompted text, so it is refused where a prompt is put before the
    text: it would cut the prompt rather than the text."""
    if body.truncate == "NONE":  # over max_tokens: refused once the lengths are known
        return {"long_inputs": "error"}
    options: dict = {"long_inputs": "truncate"}
    if body.max_tokens is not None:
        options["truncate_prompt_tokens"] = min(body.max_tokens, engine.deployment.max_model_len)
    if body.truncate == "END":
        return options
    name = prompt_name if prompt_name is not None else engine.inputs.default_prompt_name
    if name is not None and engine.inputs.prompts.get(name):
        raise APIError(
            400,
            f"truncate START is not supported for input_type {body.input_type} on this model: "
            f"its texts start with the model's {name!r} prompt, which START would cut instead "
            "of the text; use END or NONE",
            param="truncate",
            code="unsupported_value",
        )
    return {**options, "truncation_side": "left"}


def _refuse_over(num_tokens: list[int], max_tokens: int) -> None:
    """truncate NONE: 400 for the first text over ``max_tokens`` (texts over max_model_len
    were refused by the engine already)."""
    for i, n in enumerate(num_tokens):
        if n > max_tokens:
            raise APIError(
                400,
                f"texts {i} has {n} tokens, more than max_tokens={max_tokens}; with truncate "
                "NONE a longer text is refused (END or START cut it)",
                param="texts",
                code="context_length_exceeded",
            )
