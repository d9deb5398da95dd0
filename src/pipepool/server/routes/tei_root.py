"""TEI's ``POST /`` (and SageMaker's ``/invocations``, which TEI serves the same): the route of
what the model does, as TEI chooses it from the model's type: a reranker (a one-label
classifier) reranks (``/rerank``'s TEI body: ``query``, ``texts``), another classifier predicts
(``/predict``), a model whose only output is sparse answers ``/embed_sparse``, an embedding
model ``/embed``, or ``/similarity`` for a body whose ``inputs`` is an object (TEI does so
when started with TASK=sentence-similarity; an ``/embed`` body's never is). The
``huggingface_hub.InferenceClient(base_url=server)`` methods ``feature_extraction``,
``sentence_similarity`` and ``text_classification`` post here. The route is chosen by the type
of the server's first model (the one ``/info`` describes); the route then picks its model as it
always does (the only one doing its task)."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from ...errors import PipepoolError
from .. import scoring_protocol as sp
from ..errors import APIError, from_engine
from ..tei_protocol import (
    TEIEmbedRequest,
    TEIEmbedSparseRequest,
    TEIPredictRequest,
    TEISimilarityRequest,
)
from . import retrieval, scoring, tei, tei_predict
from .shared import state_of

M = TypeVar("M", bound=BaseModel)

router = APIRouter(tags=["TEI"])


def _body_schema() -> dict[str, Any]:
    """The body's schema: that of the route the model's type picks."""
    names = (
        "TEIEmbedRequest",
        "TEISimilarityRequest",
        "TEIEmbedSparseRequest",
        "TEIPredictRequest",
        "RerankRequest",
    )
    refs = [{"$ref": f"#/components/schemas/{name}"} for name in names]
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"anyOf": refs}}},
        }
    }


@router.post("/", responses=tei.TEI_ERRORS, openapi_extra=_body_schema())
@router.post("/invocations", responses=tei.TEI_ERRORS, openapi_extra=_body_schema())
async def root(request: Request) -> Response:
    """``/rerank``, ``/predict``, ``/embed_sparse`` or ``/embed``, by the model's type."""
    model = state_of(request).models.first
    try:
        d = model.front.engine.info
    except PipepoolError as exc:  # loading, or failed to start
        raise from_engine(exc) from None
    payload = await _json(request)
    head = d.classifier
    if head is not None and head.can_rerank:
        body = _parse(sp.RerankRequest, payload)
        if not body.tei:
            raise APIError(
                400,
                "this server's POST / reranks with TEI's body: query and texts (Cohere's "
                "documents go to /rerank)",
                param="texts",
            )
        return await scoring.rerank(body, request)
    if head is not None:
        return await tei_predict.predict(_parse(TEIPredictRequest, _asks(payload)), request)
    if d.outputs == ("sparse",):
        return await retrieval.embed_sparse(_parse(TEIEmbedSparseRequest, payload), request)
    if isinstance(payload, dict) and isinstance(payload.get("inputs"), dict):
        # Sentence similarity's body (TEI serves it here when started with
        # TASK=sentence-similarity): an /embed body's inputs is never an object.
        return await tei.similarity(_parse(TEISimilarityRequest, payload), request)
    return await tei.embed(_parse(TEIEmbedRequest, payload), request)


def _asks(payload: Any) -> Any:
    """The body without an empty ``parameters`` object: ``InferenceClient.text_classification``
    sends ``"parameters": {}`` when given no options, which asks for nothing. One that asks
    for something (``top_k``, ``function_to_apply``) is refused by ``/predict``'s body."""
    if isinstance(payload, dict) and payload.get("parameters") == {}:
        return {k: v for k, v in payload.items() if k != "parameters"}
    return payload


async def _json(request: Request) -> Any:
    """The body as JSON; a body sent as another type, or invalid JSON, is a validation error,
    as on every route (``errors.install_handlers`` names the Content-Type it was sent as)."""
    kind = request.headers.get("content-type")
    if kind is not None and "json" not in kind.lower():
        error = {"type": "model_attributes_type", "loc": ("body",), "msg": "not JSON"}
        raise RequestValidationError([error])
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError as exc:
        error = {"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error"}
        raise RequestValidationError([{**error, "ctx": {"error": str(exc)}}]) from None


def _parse(model: type[M], payload: Any) -> M:
    """``payload`` as ``model``; a failure is answered as a route's own body validation."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        raise RequestValidationError(errors) from None
