"""Cohere's embed routes, so Cohere's clients work as they are: v2's ``POST /v2/embed``
(``cohere.ClientV2.embed``) and v1's ``POST /v1/embed`` (``cohere.Client.embed``), each text's
embedding in every type asked for (``cohere_protocol``: int8/uint8 on the model's fixed scale,
``api/int8_scale.py``); v1's ``/v1/tokenize`` and ``/v1/detokenize`` are in
``cohere_tokens.py``, Cohere's rerank in ``scoring.py``. The same limits, errors, metrics and
API key as ``/v1/embeddings``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from fastapi import APIRouter, Request, Response

from ...api.engine import Engine
from ...api.st_compat import task_prompt_name
from ...api.vlm import CHAT_FAMILIES
from ...errors import PipepoolError
from .. import cohere_protocol as cp
from ..errors import APIError, from_engine
from ..fast_route import FastBodyRoute
from ..media_fetch import fetched
from . import cohere_tokens
from .answers import json_answer
from .cohere_inputs import embed_inputs, embed_vlm_images, refuse_text_fields
from .images import data_uri_bytes, image_meta, run_model_images
from .page_retrievers import refuse_page_retriever, vlm_family
from .shared import (
    CLIENT_CLOSED,
    ERRORS,
    ClientGone,
    model_of,
    run_model_outputs,
    select_model,
    unless_client_leaves,
)
from .tokens import served_engine

router = APIRouter(tags=["Cohere"], route_class=FastBodyRoute)
router.include_router(cohere_tokens.router)


@router.post("/v2/embed", response_model=cp.CohereEmbedResponse, responses=ERRORS)
async def embed(body: cp.CohereEmbedRequest, request: Request) -> Response:
    """Each text's embedding in every type of ``embedding_types``, in text order."""
    return await _embed(
        request,
        body,
        body.input_type,
        body.embedding_types,
        version="2",
        dimensions=body.output_dimension,
        max_tokens=body.max_tokens,
    )


@router.post(
    "/v1/embed",
    response_model=cp.CohereEmbedFloatsResponse | cp.CohereEmbedResponse,
    responses=ERRORS,
)
async def embed_v1(body: cp.CohereV1EmbedRequest, request: Request) -> Response:
    """Cohere v1: without ``embedding_types``, each text's float embedding
    (``embeddings_floats``); with them, each text's embedding in every type asked for
    (``embeddings_by_type``)."""
    return await _embed(request, body, body.input_type, body.embedding_types, version="1")


async def _embed(
    request: Request,
    body: cp.CohereEmbedRequest | cp.CohereV1EmbedRequest,
    input_type: str | None,
    types: list[cp.EmbeddingType] | None,
    *,
    version: str,
    dimensions: int | None = None,
    max_tokens: int | None = None,
) -> Response:
    """The embed answer of either version; ``types`` None: v1's floats answer."""
    model = select_model(request, body.model, "embed")
    engine = served_engine(model)
    refuse_page_retriever(model, f"/v{version}/embed answers one vector per input")
    int8 = _needs_int8(types, body.ranges)
    if isinstance(body, cp.CohereEmbedRequest) and (
        body.images is not None or body.inputs is not None
    ):
        return await _embed_images(request, body, types or ["float"], int8, dimensions)
    texts = body.texts
    assert texts is not None  # v2's validator: texts or images
    prompt_name = _prompt_name(engine, input_type)
    truncation = _truncation(engine, body.truncate, max_tokens, input_type, prompt_name)
    done = await run_model_outputs(
        request,
        texts,
        param="texts",
        dimensions=dimensions,
        prompt_name=prompt_name,
        **truncation,
    )
    if isinstance(done, Response):
        return done
    if body.truncate == "NONE" and max_tokens is not None:
        _refuse_over(done.num_tokens, max_tokens)
    vectors = done.matrix()  # [n, dim]
    ranges = None if body.ranges is None else np.asarray(body.ranges)
    bound = None
    if int8 and ranges is None:
        bound = engine.int8_bound(dimensions, wait=False)
        if bound is None:
            calibrated = await _calibrate(request, dimensions)
            if isinstance(calibrated, Response):
                return calibrated
            bound = calibrated

    def build() -> dict:
        return cp.embed_response(texts, vectors, types, done.num_tokens, (ranges, bound), version)

    try:
        return await json_answer(request, build, vectors.size * len(types or ["float"]))
    except PipepoolError as exc:  # ranges that do not fit the vectors; the engine's errors
        raise from_engine(exc) from None


async def _embed_images(
    request: Request,
    body: cp.CohereEmbedRequest,
    types: list[cp.EmbeddingType],
    int8: bool,
    dimensions: int | None,
) -> Response:
    """v2's answer for ``images`` (data URIs, files, URLs of allowed hosts; api/images.py
    embeds them, or a vision-language embedder) and for ``inputs`` (``cohere_inputs.py``): the
    texts' options are refused by name, and int8/uint8 need ``ranges`` (the model's fixed
    bound is measured on texts)."""
    refuse_text_fields(body)
    if int8:
        raise APIError(
            400,
            "int8 and uint8 of images need ranges (the model's fixed int8 bound is measured on "
            "texts); or ask for float, base64, binary or ubinary",
            param="embedding_types",
        )
    metas: list[dict] | None = None
    if body.inputs is not None:
        done = await embed_inputs(request, body, dimensions)
    else:
        assert body.images is not None  # the caller's test
        blobs = await fetched(request, data_uri_bytes(body.images, "images"), "images")
        if vlm_family(model_of(request)) in CHAT_FAMILIES:
            done = await embed_vlm_images(request, blobs, dimensions)
        else:
            done = await run_model_images(request, blobs, "images", dimensions=dimensions)
        metas = None if isinstance(done, Response) else [image_meta(blob) for blob in blobs]
    if isinstance(done, Response):
        return done
    vectors = done.matrix()
    ranges = None if body.ranges is None else np.asarray(body.ranges)

    def build() -> dict:
        return cp.embed_response(
            [], vectors, types, done.num_tokens, (ranges, None), "2", images=metas
        )

    try:
        return await json_answer(request, build, vectors.size * len(types))
    except PipepoolError as exc:  # ranges that do not fit the vectors
        raise from_engine(exc) from None


async def _calibrate(request: Request, dimensions: int | None) -> float | Response:
    """The model's int8 bound for ``dimensions``, computed by the first request that needs it
    (an engine call on the calibration texts, ``api/int8_scale.py``) on a tokenising thread,
    never on the event loop; counted as one request in the model's queue. A bare Response
    (499) if the client left meanwhile."""
    front = model_of(request).front
    computing = front.run_call(1, lambda engine: engine.int8_bound(dimensions))
    try:
        return await unless_client_leaves(request, computing)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)


def _needs_int8(types: Sequence[str] | None, ranges: list | None) -> bool:
    """Whether int8 or uint8 is asked for; 400 for ``ranges`` without either (they would
    place nothing)."""
    int8 = bool({"int8", "uint8"} & set(types or ()))
    if ranges is not None and not int8:
        raise APIError(
            400,
            "ranges places int8/uint8 buckets: ask for int8 or uint8 in embedding_types, or "
            "leave ranges out",
            param="ranges",
            code="invalid_value",
        )
    return int8


def _prompt_name(engine: Engine, input_type: str | None) -> str | None:
    """The model's prompt for Cohere's ``input_type``: its query and document prompts as
    ``encode_query`` and ``encode_document`` pick them, else one named as the input type (for
    classification and clustering); None: the model's default prompt, if any (also for no
    input type, which Cohere v1 allows)."""
    if input_type is None:
        return None
    prompts = engine.info.prompts
    if input_type == "search_query":
        return task_prompt_name(prompts, "query")
    if input_type == "search_document":
        return task_prompt_name(prompts, "document")
    return input_type if input_type in prompts else None


def _truncation(
    engine: Engine,
    truncate: str,
    max_tokens: int | None,
    input_type: str | None,
    prompt_name: str | None,
) -> dict:
    """The engine's options for Cohere's ``truncate`` and ``max_tokens``. START cuts tokens
    from the start of the prompted text, so it is refused where a prompt is put before the
    text: it would cut the prompt rather than the text."""
    if truncate == "NONE":  # over max_tokens: refused once the lengths are known
        return {"long_inputs": "error"}
    options: dict = {"long_inputs": "truncate"}
    if max_tokens is not None:
        options["truncate_prompt_tokens"] = min(max_tokens, engine.info.max_model_len)
    if truncate == "END":
        return options
    name = prompt_name if prompt_name is not None else engine.info.default_prompt_name
    if name is not None and engine.info.prompts.get(name):
        raise APIError(
            400,
            f"truncate START is not supported for input_type {input_type} on this model: "
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
