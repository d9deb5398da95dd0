"""The model cards of ``GET /v1/models`` and ``GET /v1/models/{model}``: one card per served
name, read by two peers' clients at the same paths.

OpenAI's client (``models.list``, ``models.retrieve``) reads ``{"object": "list", "data":
[cards]}`` and cards with ``id``, ``object``, ``created``, ``owned_by``. Cohere's client
(``models.list``, ``models.get``) reads ``{"models": [cards], "next_page_token"}`` and cards
with ``name``, ``endpoints``, ``context_length``, ``default_endpoints``, .... Both parse their
own fields and keep the others, so one card carries both sets, each with its peer's meaning,
and the list carries both ``data`` and ``models`` (the same cards).

Cohere's ``endpoints`` for what a model does here: ``embed`` (dense vectors), ``rerank`` (a
model that scores pairs), ``classify`` (a sequence classifier). A model is the *default* for an
endpoint when a request for that endpoint that names no model goes to it (``ServedModels.select``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import APIError
from .models import ServedModel, ServedModels

# Cohere's endpoint -> the tasks (api.router.TASKS) that answer it here.
COHERE_ENDPOINTS: dict[str, tuple[str, ...]] = {
    "embed": ("embed",),
    "rerank": ("rerank",),
    "classify": ("classify",),
}
# Every endpoint Cohere's document names (its CompatibleEndpoint); those pipepool does not serve
# list no model.
COHERE_ALL_ENDPOINTS = ("chat", "embed", "classify", "summarize", "rerank", "rate", "generate")
# Cohere's page_size bounds (its document's description: 1-1000, default 20).
_MAX_PAGE_SIZE = 1000


def endpoints_of(tasks: Sequence[str] | None) -> list[str]:
    """Cohere's endpoints a model with ``tasks`` answers (none while it loads)."""
    offered = set(tasks or ())
    return [e for e, need in COHERE_ENDPOINTS.items() if offered.intersection(need)]


def default_endpoints(model: ServedModel, models: ServedModels) -> list[str]:
    """The endpoints for which a request naming no model is answered by ``model``."""
    chosen = []
    for endpoint, tasks in COHERE_ENDPOINTS.items():
        try:
            if models.select(None, tasks) is model and endpoint in endpoints_of(model.tasks()):
                chosen.append(endpoint)
        except APIError:
            continue
    return chosen


def model_card(
    name: str, model: ServedModel, models: ServedModels, created: int, max_model_len: int | None
) -> dict:
    """One name's card: OpenAI's fields, pipepool's (``root``, ``tasks``, ``max_model_len``
    once loaded), and Cohere's."""
    tasks = model.tasks()
    card: dict = {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "pipepool",
        "root": model.name,
        "name": name,
        "is_deprecated": False,
        "endpoints": endpoints_of(tasks),
        "default_endpoints": default_endpoints(model, models),
        "finetuned": False,
        "features": [],
    }
    # Cohere's document types both as present: unknown ones (a loading model's length; no
    # tokenizer file is served) are left out, not null.
    if max_model_len is not None:
        card["context_length"] = max_model_len
        card["max_model_len"] = max_model_len
    if tasks is not None:
        card["tasks"] = list(tasks)
    return card


@dataclass(frozen=True)
class CardQuery:
    """Cohere's filters and pages of ``GET /v1/models`` (OpenAI's list takes none): only
    models with ``endpoint``; with ``default_only`` (which needs ``endpoint``) only the default
    one; ``page_size`` cards from the offset that ``page_token`` names."""

    endpoint: str | None = None
    default_only: bool = False
    page_size: float | None = None  # a number in Cohere's document; a whole one is a size
    page_token: str | None = None

    def check(self) -> None:
        """400, naming the parameter, for a query Cohere's document calls invalid."""
        if self.endpoint is not None and self.endpoint not in COHERE_ALL_ENDPOINTS:
            raise APIError(
                400,
                f"endpoint {self.endpoint!r}: Cohere's endpoints are "
                f"{', '.join(COHERE_ALL_ENDPOINTS)}",
                param="endpoint",
            )
        if self.default_only and self.endpoint is None:
            raise APIError(400, "default_only needs an endpoint", param="default_only")
        size = self.page_size
        if size is not None and not (size.is_integer() and 1 <= size <= _MAX_PAGE_SIZE):
            raise APIError(
                400,
                f"page_size must be a whole number 1-{_MAX_PAGE_SIZE}, got {size}",
                param="page_size",
            )
        if self.page_token is not None and not self.page_token.isdigit():
            raise APIError(
                400,
                "page_token must be the next_page_token of the previous page",
                param="page_token",
            )

    def keeps(self, card: dict) -> bool:
        if self.endpoint is None:
            return True
        if self.endpoint not in COHERE_ENDPOINTS:
            return False  # an endpoint no model here answers (chat, generate, ...)
        listed = card["default_endpoints"] if self.default_only else card["endpoints"]
        return self.endpoint in listed

    def page(self, cards: list[dict]) -> tuple[list[dict], str | None]:
        """This page's cards and the token of the next page (None on the last)."""
        start = int(self.page_token or 0)
        if self.page_size is None:
            return cards[start:], None
        end = start + int(self.page_size)
        return cards[start:end], (str(end) if end < len(cards) else None)
