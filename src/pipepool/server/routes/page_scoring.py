"""A page retriever's (ColQwen2, ColPali) ``/score`` and ``/rerank``: text queries against page
images by MaxSim, as ``Engine.score`` and ``Engine.rerank`` compute it
(``api/page_retrieval.py``). A page is a document in vLLM's multimodal form, ``{"content":
[{"type": "image_url", "image_url": {"url": ...}}]}`` (one image: data URI, file under
--allowed-local-media-path, URL of an allowed host); a query a string or ``{"content": [{"type":
"text", "text": ...}]}``. The options of text pairs are refused by name (the engine's
``refuse_page_options``), and so are content parts anywhere for any other model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from fastapi import Request, Response

from ...api.page_retrieval import counted_page_scores, refuse_page_options
from ...api.scoring import ranking
from ...errors import InvalidInputError
from ...intake.conversation import RemoteImage
from .. import scoring_protocol as sp
from ..errors import APIError, from_engine
from ..front import INLINE_SIZE, EngineCall
from ..limits import check_input_count
from ..media_fetch import fetched
from ..models import ServedModel
from .answers import json_answer
from .images import image_from_uri, renamed
from .page_retrievers import page_retriever
from .shared import check_task, model_of, run_engine, select_model, state_of


def takes_pages(request: Request, model: str | None, task: str, sides: list[Any]) -> bool:
    """Whether a score or rerank request goes here: its model is a page retriever. 400 for content
    parts (in ``sides``) sent to any other model."""
    served = select_model(request, model, task)
    if page_retriever(served) is not None:
        return True
    for name, value in sides:
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, sp.ScoreContent) for v in values):
            raise APIError(
                400,
                f"{name} holds content parts (vLLM's multimodal form), which page retrievers "
                f"(ColQwen2, ColPali) take as page images; model {served.name} scores texts",
                param=name,
                code="invalid_value",
            )
    return False


async def page_rerank(request: Request, body: sp.RerankRequest) -> Response:
    """A page retriever's rerank answer: pages by MaxSim against the query, best first."""
    retriever = _retriever(request)
    if body.texts is not None or body.rank_fields is not None:
        name = "texts" if body.texts is not None else "rank_fields"
        raise APIError(400, f"{name}: {retriever} ranks page images (documents as content "
                       "parts)", param=name, code="invalid_value")  # fmt: skip
    if body.max_tokens_per_query is not None:
        _refuse("max_tokens_per_query")
    assert body.documents is not None  # RerankRequest: documents or texts
    documents = body.documents if isinstance(body.documents, list) else [body.documents]
    if body.return_documents:
        _refuse("return_documents")
    cut = body.truncation()
    activation = body.activation()
    options: dict[str, Any] = dict(
        use_activation=activation, instruction=body.instruction,
        max_tokens_per_doc=body.per_doc, max_chunks_per_doc=body.max_chunks_per_doc,
        truncate_prompt_tokens=cut.tokens, long_inputs=cut.long_inputs, weights=body.weights,
        truncation_side=cut.side,
    )  # fmt: skip
    _check_options(options)
    query = _query(body.query, "query", retriever)
    sources = [_page(d, i, "documents", retriever) for i, d in enumerate(documents)]
    pages = await fetched(request, sources, "documents")  # once every check is made
    work = _work(request, "rerank", [query], pages, "documents", activation)
    done = await run_engine(request, work)
    if isinstance(done, Response):
        return done
    scores, tokens = done
    order = ranking(scores, body.top_n)
    name = model_of(request).names.response_name(body.model)
    answer_id = body.answer_id("rerank")
    return await json_answer(
        request, lambda: sp.rerank_response(answer_id, name, None, scores, order, tokens),
        len(scores),
    )  # fmt: skip


async def page_score(request: Request, body: sp.ScoreRequest) -> Response:
    """A page retriever's score answer: one MaxSim per query-page pair (1:N or N:N)."""
    first, second, retriever = *body.sides, _retriever(request)
    for name in ("max_tokens_per_query", "max_tokens_per_doc"):
        if getattr(body, name) is not None:
            _refuse(name)
    firsts, seconds = getattr(body, first), getattr(body, second)
    firsts = firsts if isinstance(firsts, list) else [firsts]
    seconds = seconds if isinstance(seconds, list) else [seconds]
    if len(firsts) not in (1, len(seconds)):
        raise APIError(
            400,
            f"{first} has {len(firsts)} queries and {second} {len(seconds)} pages: give one "
            f"query (scored against every page) or as many as pages",
            param=first,
            code="invalid_value",
        )
    cut = body.truncation()
    activation = body.use_activation if body.use_activation is not None else True
    options: dict[str, Any] = dict(
        use_activation=activation,
        instruction=body.instruction, truncate_prompt_tokens=cut.tokens, weights=body.weights,
        truncation_side=cut.side,
    )  # fmt: skip
    _check_options(options)
    queries = [_query(q, f"{first}[{i}]", retriever) for i, q in enumerate(firsts)]
    sources = [_page(d, i, second, retriever) for i, d in enumerate(seconds)]
    pages = await fetched(request, sources, second)  # once every check is made
    work = _work(request, "score", queries, pages, second, activation)
    done = await run_engine(request, work)
    if isinstance(done, Response):
        return done
    scores, tokens = done
    name = model_of(request).names.response_name(body.model)
    answer_id = body.answer_id("score")
    return await json_answer(
        request, lambda: sp.score_response(answer_id, name, scores, tokens), len(scores)
    )


def _check_options(options: dict) -> None:
    """The text pairs' options given, refused by name as ``Engine.score`` refuses them."""
    given = {k: v for k, v in options.items() if k != "use_activation"}
    given["truncation_side"] = None if given["truncation_side"] == "right" else "left"
    try:
        refuse_page_options(**given)
    except InvalidInputError as exc:
        raise from_engine(exc) from None


def _work(
    request: Request, task: str, queries: list[str], pages: list, param: str, activation: bool
) -> EngineCall:
    """``Engine.score`` of the queries against the pages, as an engine call that waits for its
    MaxSim scores; page i's refusals name ``param[i]``."""
    model: ServedModel = model_of(request)
    check_task(model, task)
    check_input_count(state_of(request).settings, len(pages), param)

    def call(engine) -> tuple[np.ndarray, list[int]]:
        return counted_page_scores(engine, queries, pages, use_activation=activation)

    weights = [range(INLINE_SIZE + 1 + (len(p) if isinstance(p, bytes) else 0)) for p in pages]
    return EngineCall(weights, call=call, renamed=lambda exc: renamed(exc, param))


def _retriever(request: Request) -> str:
    name = page_retriever(model_of(request))
    assert name is not None  # takes_pages chose this route
    return name


def _query(value: Any, where: str, retriever: str) -> str:
    if isinstance(value, str):
        return value
    parts = value.content
    if len(parts) != 1 or parts[0].get("type") != "text" or set(parts[0]) != {"type", "text"} \
            or not isinstance(parts[0]["text"], str):  # fmt: skip
        raise APIError(400, f"{where}: a {retriever} query is a string or content of one text "
                       "part ({type: text, text})", param=where.split("[")[0],
                       code="invalid_value")  # fmt: skip
    return parts[0]["text"]


def _page(value: Any, i: int, param: str, retriever: str) -> bytes | Path | RemoteImage:
    where = f"{param}[{i}]"
    parts = value.content if isinstance(value, sp.ScoreContent) else None
    image = parts[0].get("image_url") if parts and len(parts) == 1 else None
    if (
        parts is None or len(parts) != 1 or parts[0].get("type") != "image_url"
        or set(parts[0]) != {"type", "image_url"} or not isinstance(image, dict)
        or set(image) - {"url", "detail"} or not isinstance(image.get("url"), str)
        or image.get("detail", "auto") != "auto"
    ):  # fmt: skip
        raise APIError(
            400,
            f"{where}: a {retriever} document is a page image, as content of one image_url part "
            '({"content": [{"type": "image_url", "image_url": {"url": ...}}]}; detail auto)',
            param=param,
            code="invalid_value",
        )
    return image_from_uri(image["url"], f"{where}.content[0].image_url.url", param)


def _refuse(name: str) -> None:
    try:
        refuse_page_options(**{name: True})
    except InvalidInputError as exc:
        raise from_engine(exc) from None
