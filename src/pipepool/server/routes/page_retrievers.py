"""Which served models are vision-language models (``api/vlm.py``), and the one refusal of a page
retriever (ColQwen2, ColPali) on a route it does not serve: it gives one vector per token of a
query or a page, so only /pooling's token_embed, /score and /rerank (MaxSim) answer for it. Kept
apart from the routes so that the shared checks (``shared.check_task``) can use it."""

from __future__ import annotations

from ...api.vlm import PAGE_RETRIEVERS, VLM_FAMILIES
from ...errors import ModelLoadError, PipepoolError
from ...models import family_of
from ..errors import APIError, from_engine
from ..models import ServedModel

# The routes that serve a page retriever, as every refusal names them.
SERVED_BY = (
    "it is served by /pooling with task token_embed (its token vectors), and by /score and "
    "/rerank (MaxSim of text queries against page images)"
)


def vlm_family(model: ServedModel) -> str | None:
    """The served model's vision-language family (``CHAT_FAMILIES``, ``PAGE_FAMILIES``), None
    for any other model; 503 while it loads."""
    try:
        architecture = model.front.engine.info.architecture
    except PipepoolError as exc:  # loading, or failed to start
        raise from_engine(exc) from None
    try:
        name = family_of(architecture).name
    except ModelLoadError:  # a dual encoder: not one of the decoder families
        return None
    return name if name in VLM_FAMILIES else None


def page_retriever(model: ServedModel) -> str | None:
    """The served model's name as a page retriever (ColQwen2, ColPali), None for others."""
    family = vlm_family(model)
    return PAGE_RETRIEVERS.get(family) if family is not None else None


def refuse_page_retriever(model: ServedModel, asked: str, param: str = "model") -> None:
    """400 (field ``param``) where ``model`` is a page retriever and the request asks what it
    does not give (``asked``, e.g. "/embed answers one vector per input"); nothing for any
    other model."""
    retriever = page_retriever(model)
    if retriever is not None:
        raise APIError(
            400,
            f"model {model.name} is {retriever}, a page retriever: it gives one vector per token "
            f"of a query or a page, and {asked}; {SERVED_BY}",
            param=param,
            code="invalid_value",
        )
