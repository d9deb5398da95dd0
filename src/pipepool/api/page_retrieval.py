"""Page retrieval with ColQwen2 (``models/colqwen2.py``) or ColPali (``models/colpali.py``):
queries (texts) against pages (images), each embedded as one vector per token, scored by MaxSim
(``retrieval.max_sim``, the score their processors' ``score_retrieval`` computes for one query
and one page). ``Engine.score`` and ``Engine.rerank`` of such an engine come here: the first
texts are queries, the second inputs page images (PIL images, bytes or ``pathlib.Path``s)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InvalidInputError
from ..intake.images import is_image_input
from .retrieval import max_sim
from .scoring import RerankResult, check_top_n, ranking

if TYPE_CHECKING:
    from .engine import Engine


def refuse_page_options(**given: object) -> None:
    """Options of text pairs that mean nothing for a query against a page image."""
    for name, value in given.items():
        if value is not None:
            raise InvalidInputError(
                f"{name} does not apply to queries against page images (ColQwen2, ColPali)",
                param=name,
            )


def page_scores(
    engine: Engine, text_1: str | Sequence[str], pages, *, use_activation: bool = True
) -> np.ndarray:
    """One MaxSim per pair: one query against every page, or ``text_1[i]`` with ``pages[i]``;
    ``[n]`` float32. MaxSim has no activation: ``use_activation`` is checked, changes nothing."""
    return counted_page_scores(engine, text_1, pages, use_activation=use_activation)[0]


def counted_page_scores(
    engine: Engine, text_1: str | Sequence[str], pages, *, use_activation: bool = True
) -> tuple[np.ndarray, list[int]]:
    """``page_scores`` and the tokens of each prompt embedded for them (each distinct query
    once, then each page), for a server's usage."""
    if not isinstance(use_activation, bool):
        raise InvalidInputError("use_activation must be true or false", param="use_activation")
    queries = [text_1] if isinstance(text_1, str) else list(text_1)
    if not queries or not all(isinstance(q, str) for q in queries):
        raise InvalidInputError(
            "the queries (text_1) against page images are texts", param="text_1"
        )
    pages = [pages] if is_image_input(pages) else list(pages)
    bad = next((i for i, p in enumerate(pages) if not is_image_input(p)), None)
    if not pages or bad is not None:
        raise InvalidInputError(
            f"the pages (text_2) of ColQwen2 / ColPali are images (PIL, bytes or pathlib.Path)"
            f"{f'; input {bad} is not' if bad is not None else ''}",
            param="text_2",
        )
    if len(queries) == 1:
        queries = queries * len(pages)
    elif len(queries) != len(pages):
        raise InvalidInputError(
            f"{len(queries)} queries and {len(pages)} pages: give one query (scored against "
            "every page) or as many as pages",
            param="text_1",
        )
    unique = list(dict.fromkeys(queries))
    query_call = engine.submit([{"text": q} for q in unique], pooling="all")
    page_call = engine.submit([{"image": p} for p in pages], pooling="all")
    query_vectors, page_vectors = query_call.result(), page_call.result()
    row = {q: i for i, q in enumerate(unique)}
    scores = np.array(
        [
            max_sim(query_vectors[row[q]], page)
            for q, page in zip(queries, page_vectors, strict=True)
        ],
        dtype=np.float32,
    )
    return scores, [*query_call.num_tokens.tolist(), *page_call.num_tokens.tolist()]


def page_rerank(
    engine: Engine, query: str, pages, *, top_n: int | None, use_activation: bool = True
) -> list[RerankResult]:
    """``pages`` by MaxSim against ``query``, best first (ties: input order); the documents of
    the results are None (a page is an image, not a text to return)."""
    check_top_n(top_n)
    if not isinstance(query, str):
        raise InvalidInputError("query must be a string", param="query")
    scores = page_scores(engine, query, pages, use_activation=use_activation)
    return [RerankResult(i, float(scores[i])) for i in ranking(scores, top_n).tolist()]
