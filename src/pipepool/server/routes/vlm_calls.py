"""Vision-language embedders over HTTP (``api/vlm.py``): which served models take which input
forms, and the engine call of their inputs. A Qwen2-VL / Qwen2.5-VL / Qwen3-VL embedder takes
conversations (vLLM's ``messages``, rendered by its chat template: ``intake/vlm_chat.py``) and
texts with images (Cohere's ``inputs`` content parts, ``images``), one vector per input; a page
retriever (ColQwen2, ColPali) embeds a query (a text) or a page (one image) as one vector per
token, so it answers where a route can carry token vectors (/pooling's token_embed) and scores
and reranks by MaxSim (``page_scoring.py``)."""

from __future__ import annotations

from pathlib import Path

from fastapi import Request

from ...intake.conversation import Conversation, ImagePart, ImageSource
from ...intake.token_budget import InputOverBudgetError, TokenBudgetError
from ..errors import APIError
from ..front import INLINE_SIZE, EngineCall
from ..limits import check_input_count, over_budget, request_budget
from ..models import ServedModel
from ..pooling_protocol import PoolingRequest
from ..settings import ServerSettings
from .images import renamed
from .shared import check_task, model_of, state_of


def with_images(conversation: Conversation, images: list[bytes | Path]) -> Conversation:
    """``conversation`` with its image parts' sources replaced by ``images``, in order (its
    remote images once fetched)."""
    found = iter(images)
    messages = tuple(
        type(m)(m.role, tuple(
            ImagePart(next(found), p.where) if isinstance(p, ImagePart) else p for p in m.parts
        ))
        for m in conversation.messages
    )  # fmt: skip
    return Conversation(messages)


def vlm_call(
    settings: ServerSettings,
    model: ServedModel,
    items: list,
    param: str,
    names: list[str] | None,
    options: dict,
) -> EngineCall:
    """``Engine.submit(items, **options)`` (dict inputs or ``ChatPrompt``s) as an engine call
    within the request's token budget, placeholders counted; the engine's refusals of input
    i a 400 (field ``param``) naming ``names[i]`` (default ``param[i]``). 404 for a model
    that does not embed."""
    check_task(model, "embed")
    check_input_count(settings, len(items), param)
    budget = request_budget(settings, model.front.engine.info)
    # Images are decoded on a lane, never on the event loop: each input weighs over the
    # inline size (``routes/images.images_call`` says why).
    weights = [range(INLINE_SIZE + 1 + _image_bytes(item)) for item in items]

    def submit(engine):
        try:
            return engine.submit(items, **options, budget=budget)
        except (TokenBudgetError, InputOverBudgetError) as exc:
            raise over_budget(settings, exc, param) from None

    return EngineCall(weights, submit=submit, renamed=lambda exc: renamed(exc, param, names))


def query_call(request: Request, body: PoolingRequest, normalize: bool | None) -> EngineCall:
    """A page retriever's token vectors of ``body.input``'s texts (/pooling), each a query in its
    processor's format; the texts' options go along, for the engine to refuse by name."""
    texts = body.inputs()
    if not all(isinstance(t, str) for t in texts):
        raise APIError(400, "a page retriever's queries are texts, not token ids", param="input",
                       code="invalid_value")  # fmt: skip
    options = {
        "pooling": "all",
        "normalize": normalize,
        "truncate_prompt_tokens": body.truncate_prompt_tokens,
        "truncation_side": body.truncation_side or "right",
        "long_inputs": body.long_inputs,
    }
    if "add_special_tokens" in body.model_fields_set:
        raise APIError(400, "add_special_tokens is not taken for a page retriever: a query is "
                       "formatted as its processor formats it", param="add_special_tokens",
                       code="invalid_value")  # fmt: skip
    items = [{"text": t} for t in texts]
    settings, model = state_of(request).settings, model_of(request)
    return vlm_call(settings, model, items, "input", None, options)


def _image_bytes(item) -> int:
    images: list[ImageSource] = item.images if hasattr(item, "images") else (
        item.get("images") or ([item["image"]] if "image" in item else [])
    )  # fmt: skip
    return sum(len(i) for i in images if isinstance(i, bytes))
