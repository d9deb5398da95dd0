"""The scoring routes of a classifier (cross-encoder, reranker): Cohere v2 / Jina ``POST
/rerank`` (also ``/v1/rerank``, ``/v2/rerank``; TEI's body form too), vLLM's ``/score`` and
``/classify``. The same limits, errors, metrics and API key as ``/v1/embeddings``: a request's
pairs (or texts) are engine requests like any inputs, sharing steps with other clients.
A ColBERT model reranks and scores by MaxSim, BGE-M3 by its weighted mix (``weights``):
``Engine.submit_pairs`` computes those before it returns (``api/retrieval_scoring.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from fastapi import APIRouter, Request, Response

from ...api.engine import Engine
from ...api.scoring import check_top_n, pair_up, ranking
from ...api.submission import Submission
from ...errors import InvalidInputError
from .. import scoring_protocol as sp
from ..errors import APIError, from_engine
from ..front import Encoded
from ..limits import bounded_scoring, check_input_count
from .shared import (
    CLIENT_CLOSED,
    ERRORS,
    ClientGone,
    check_task,
    json_answer,
    model_of,
    select_model,
    state_of,
    unless_client_leaves,
)

router = APIRouter(tags=["rerank, score, classify"])


@router.post("/rerank", response_model=sp.RerankAnswer, responses=ERRORS)
@router.post("/v1/rerank", response_model=sp.RerankAnswer, responses=ERRORS)
@router.post("/v2/rerank", response_model=sp.RerankAnswer, responses=ERRORS)
async def rerank(body: sp.RerankRequest, request: Request) -> Response:
    """Documents by relevance to the query, most relevant first (Cohere v2 / Jina; with
    ``texts`` instead of ``documents``, TEI's request and answer)."""
    documents = body.document_texts()
    if not documents:
        raise APIError(400, "documents is empty: send at least one document", param="documents")
    try:
        check_top_n(body.top_n)
    except InvalidInputError as exc:
        raise from_engine(exc) from None
    n = len(documents)
    done = await _run(
        request,
        body.model,
        "rerank",
        n,
        lambda engine: engine.submit_pairs(
            [body.query] * n,
            documents,
            use_activation=body.activation(),
            instruction=body.instruction,
            max_tokens_per_doc=body.max_tokens_per_doc,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
            weights=body.weights,
        ),
        param="texts" if body.tei else "documents",
        texts=[body.query, *documents],
        truncate_prompt_tokens=body.truncate_prompt_tokens,
    )
    if isinstance(done, Response):
        return done
    scores = np.array([out[0] for out in done.outputs], dtype=np.float32)
    order = ranking(scores, body.top_n)
    quoted = body.return_text if body.tei else body.return_documents is not False
    size = n + (sum(map(len, documents)) if quoted else 0)
    if body.tei:
        return await json_answer(
            request,
            lambda: sp.tei_rerank_response(documents, scores, order, return_text=quoted),
            size,
        )
    name = model_of(request).names.response_name(body.model)
    return await json_answer(
        request,
        lambda: sp.rerank_response(
            name, documents, scores, order, done.num_tokens, return_documents=quoted
        ),
        size,
    )


@router.post("/score", response_model=sp.ScoreResponse, responses=ERRORS)
@router.post("/v1/score", response_model=sp.ScoreResponse, responses=ERRORS)
async def score(body: sp.ScoreRequest, request: Request) -> Response:
    """One score per pair: text_1 against every text_2, or text_1[i] with text_2[i] (vLLM)."""
    try:
        firsts, seconds = pair_up(body.text_1, body.text_2)
    except InvalidInputError as exc:
        raise from_engine(exc) from None
    activation = body.use_activation if body.use_activation is not None else True
    done = await _run(
        request,
        body.model,
        "score",
        len(firsts),
        lambda engine: engine.submit_pairs(
            firsts,
            seconds,
            use_activation=activation,
            instruction=body.instruction,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
            weights=body.weights,
        ),
        param="text_2",
        texts=[*firsts, *seconds],
        truncate_prompt_tokens=body.truncate_prompt_tokens,
    )
    if isinstance(done, Response):
        return done
    scores = np.array([out[0] for out in done.outputs], dtype=np.float32)
    name = model_of(request).names.response_name(body.model)
    return await json_answer(
        request, lambda: sp.score_response(name, scores, done.num_tokens), len(scores)
    )


@router.post("/classify", response_model=sp.ClassifyResponse, responses=ERRORS)
@router.post("/v1/classify", response_model=sp.ClassifyResponse, responses=ERRORS)
async def classify(body: sp.ClassifyRequest, request: Request) -> Response:
    """Label probabilities and the top label per input (vLLM)."""
    texts = body.texts()
    if not texts:
        raise APIError(400, "input is empty: send at least one text", param="input")
    activation = body.use_activation if body.use_activation is not None else True
    done = await _run(
        request,
        body.model,
        "classify",
        len(texts),
        lambda engine: engine.submit_classify(
            texts, use_activation=activation, truncate_prompt_tokens=body.truncate_prompt_tokens
        ),
        param="input",
        texts=texts,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
    )
    if isinstance(done, Response):
        return done
    model = model_of(request)
    head = model.front.engine.deployment.classifier
    assert head is not None, "submit_classify refuses a model without a classifier"
    labels = head.labels
    name = model.names.response_name(body.model)
    probs = np.stack(done.outputs).astype(np.float32, copy=False)
    return await json_answer(
        request, lambda: sp.classify_response(name, probs, labels, done.num_tokens), probs.size
    )


async def _run(
    request: Request,
    model: str | None,
    task: str,
    n: int,
    submit: Callable[[Engine], Submission],
    *,
    param: str,
    texts: Sequence,
    truncate_prompt_tokens: int | None,
) -> Encoded | Response:
    """The shared path of the model routes: the model name and the task (404 for a model that
    cannot do it), the server's limits (inputs and tokens per request), the tokenising lane
    (by the size of ``texts``), the queue, the engine's errors as 4xx/5xx, and a 499 if the
    client leaves meanwhile."""
    state = state_of(request)
    served = select_model(request, model, task)
    check_task(served, task)
    check_input_count(state.settings, n, param)
    bounded = bounded_scoring(state.settings, n, truncate_prompt_tokens, submit, param)
    try:
        return await unless_client_leaves(request, served.front.run(n, bounded, texts))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
