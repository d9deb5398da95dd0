"""The scoring routes of a classifier (cross-encoder, reranker): Cohere / Jina / vLLM ``POST
/rerank`` (also ``/v1/rerank``, ``/v2/rerank``; TEI's body form too), vLLM's ``/score`` and
``/classify`` (what each field does: ``scoring_protocol``). The same limits, errors, metrics
and API key as ``/v1/embeddings``: a request's pairs (or texts) are engine requests like any
inputs, sharing steps with other clients. A ColBERT model reranks and scores by MaxSim,
BGE-M3 by its weighted mix (``weights``): ``Engine.submit_pairs`` computes those before it
returns (``api/retrieval_scoring.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from fastapi import APIRouter, Request, Response

from ...api.engine import Engine
from ...api.pair_options import best_chunk_scores
from ...api.scoring import check_top_n, pair_up, ranking
from ...core.submission import Submission
from ...errors import InvalidInputError
from .. import scoring_protocol as sp
from ..errors import EMPTY, APIError, answer_as_tei, from_engine
from ..front import Encoded
from ..limits import bounded_scoring, check_input_count, check_inputs
from .answers import json_answer
from .page_scoring import page_rerank, page_score, takes_pages
from .shared import (
    CLIENT_CLOSED,
    ERRORS,
    ClientGone,
    check_task,
    model_of,
    select_model,
    state_of,
    unless_client_leaves,
)
from .tei import TEI_FORM_ERRORS

router = APIRouter(tags=["rerank, score, classify"])


_RERANK_ERRORS = {**ERRORS, **TEI_FORM_ERRORS}  # TEI's form answers TEI's statuses


@router.post("/rerank", response_model=sp.RerankAnswer, responses=_RERANK_ERRORS)
@router.post("/v1/rerank", response_model=sp.RerankAnswer, responses=_RERANK_ERRORS)
@router.post("/v2/rerank", response_model=sp.RerankAnswer, responses=_RERANK_ERRORS)
async def rerank(body: sp.RerankRequest, request: Request) -> Response:
    """Documents by relevance to the query, most relevant first (Cohere v1 / v2, Jina, vLLM;
    with ``texts`` instead of ``documents``, TEI's request, answer and errors)."""
    if body.tei:
        answer_as_tei(request.scope)
    sides = [("query", body.query), ("documents", body.documents)]
    if takes_pages(request, body.model, "rerank", sides):
        return await page_rerank(request, body)
    body.check_form()
    query = body.query
    assert isinstance(query, str)  # content parts: takes_pages answered or refused them
    documents = body.document_texts()
    param = "texts" if body.tei else "documents"
    if not documents:
        raise APIError(
            400,
            f"{param} is empty: send at least one document",
            param=param,
            code=EMPTY if body.tei else None,
        )
    try:
        check_top_n(body.top_n)
    except InvalidInputError as exc:
        raise from_engine(exc) from None
    activation, cut = body.activation(), body.truncation()
    n = len(documents)
    chunk_owners: list[np.ndarray] = []  # each chunk's document, when documents are chunked

    def submit(engine: Engine) -> Submission:
        options: dict[str, Any] = dict(
            use_activation=activation,
            instruction=body.instruction,
            max_tokens_per_doc=body.per_doc,
            max_tokens_per_query=body.per_query,
            truncate_prompt_tokens=cut.tokens,
            long_inputs=cut.long_inputs,
            weights=body.weights,
        )
        queries = [query] * n
        if body.max_chunks_per_doc is None:
            return engine.submit_pairs(queries, documents, truncation_side=cut.side, **options)
        submission, owners = engine.submit_chunked_pairs(
            queries, documents, max_chunks_per_doc=body.max_chunks_per_doc, **options
        )
        chunk_owners.append(owners)
        return submission

    done = await _run(
        request,
        body.model,
        "rerank",
        n,
        submit,
        param=param,
        texts=[query, *documents],
        truncate_prompt_tokens=cut.tokens,
        prompts=n * (body.max_chunks_per_doc or 1),
    )
    if isinstance(done, Response):
        return done
    scores = np.array([out[0] for out in done.outputs], dtype=np.float32)
    if chunk_owners:
        scores = best_chunk_scores(scores, chunk_owners[0])
    order = ranking(scores, body.top_n)
    if body.tei:
        quoted = bool(body.return_text)
        size = n + (sum(map(len, documents)) if quoted else 0)
        return await json_answer(
            request,
            lambda: sp.tei_rerank_response(documents, scores, order, return_text=quoted),
            size,
        )
    returned = body.returned()
    size = n + (sum(map(len, documents)) if returned is not None else 0)
    name = model_of(request).names.response_name(body.model)
    answer_id = body.answer_id("rerank")
    return await json_answer(
        request,
        lambda: sp.rerank_response(answer_id, name, returned, scores, order, done.num_tokens),
        size,
    )


@router.post("/score", response_model=sp.ScoreResponse, responses=ERRORS)
@router.post("/v1/score", response_model=sp.ScoreResponse, responses=ERRORS)
async def score(body: sp.ScoreRequest, request: Request) -> Response:
    """One score per pair (vLLM): the first side's one text against every text of the
    second, or the two sides' texts pairwise (ColQwen2, ColPali: queries against page images)."""
    first, second = body.sides
    sides = [(name, getattr(body, name)) for name in (first, second)]
    if takes_pages(request, body.model, "score", sides):
        return await page_score(request, body)
    try:
        firsts, seconds = pair_up(
            getattr(body, first), getattr(body, second), name_1=first, name_2=second
        )
    except InvalidInputError as exc:
        raise from_engine(exc) from None
    activation = body.use_activation if body.use_activation is not None else True
    cut = body.truncation()
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
            max_tokens_per_doc=body.per_doc,
            max_tokens_per_query=body.per_query,
            truncate_prompt_tokens=cut.tokens,
            truncation_side=cut.side,
            weights=body.weights,
        ),
        param=second,
        texts=[*firsts, *seconds],
        truncate_prompt_tokens=cut.tokens,
    )
    if isinstance(done, Response):
        return done
    scores = np.array([out[0] for out in done.outputs], dtype=np.float32)
    name = model_of(request).names.response_name(body.model)
    answer_id = body.answer_id("score")
    return await json_answer(
        request, lambda: sp.score_response(answer_id, name, scores, done.num_tokens), len(scores)
    )


@router.post("/classify", response_model=sp.ClassifyResponse, responses=ERRORS)
@router.post("/v1/classify", response_model=sp.ClassifyResponse, responses=ERRORS)
async def classify(body: sp.ClassifyRequest, request: Request) -> Response:
    """Label probabilities and the top label per input (vLLM)."""
    texts = body.inputs()
    check_inputs(state_of(request).settings, texts)
    activation = body.use_activation if body.use_activation is not None else True
    cut = body.truncation()
    done = await _run(
        request,
        body.model,
        "classify",
        len(texts),
        lambda engine: engine.submit_classify(
            texts,
            use_activation=activation,
            truncate_prompt_tokens=cut.tokens,
            truncation_side=cut.side,
        ),
        param="input",
        texts=texts,
        truncate_prompt_tokens=cut.tokens,
    )
    if isinstance(done, Response):
        return done
    model = model_of(request)
    head = model.front.engine.info.classifier
    assert head is not None, "submit_classify refuses a model without a classifier"
    labels = head.labels
    name = model.names.response_name(body.model)
    probs = done.matrix().astype(np.float32, copy=False)
    answer_id = body.answer_id("classify")
    return await json_answer(
        request,
        lambda: sp.classify_response(answer_id, name, probs, labels, done.num_tokens),
        probs.size,
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
    prompts: int | None = None,
) -> Encoded | Response:
    """The shared path of the model routes: the model name and the task (404 for a model that
    cannot do it), the server's limits (``n`` inputs; the tokens of at most ``prompts``
    prompts, default ``n``, per request), the tokenising lane (by the size of ``texts``), the
    queue, the engine's errors as 4xx/5xx, and a 499 if the client leaves meanwhile."""
    state = state_of(request)
    served = select_model(request, model, task)
    check_task(served, task)
    check_input_count(state.settings, n, param)
    bounded = bounded_scoring(state.settings, prompts or n, truncate_prompt_tokens, submit, param)
    try:
        return await unless_client_leaves(request, served.front.run(n, bounded, texts))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
