"""vLLM's chat form (``messages``) of a vision-language embedder, one input per body: a Qwen2-VL /
Qwen2.5-VL / Qwen3-VL embedder renders the whole conversation with its chat template as vLLM
does for an embedding model (``intake/vlm_chat.py``: ``add_generation_prompt`` and
``continue_final_message`` default false, ``chat_template_kwargs`` given to the template, no
special tokens added unless ``add_special_tokens``), images at their placeholders, and pools it
as ``Engine.embed`` does; a page retriever (ColQwen2, ColPali) embeds one message's one part, a
text as a query or an image as a page, as token vectors (/pooling's token_embed)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from fastapi import Request

from ...errors import PipepoolError
from ...intake.chat_templates import check_chat_prompt
from ...intake.conversation import Conversation, ImagePart
from ...intake.vlm_chat import ChatPrompt
from ..chat_messages import PARAM
from ..errors import APIError, from_engine
from ..front import EngineCall
from ..media_fetch import fetched
from ..models import ServedModel
from ..protocol import InputsRequest
from .page_retrievers import page_retriever
from .shared import model_of, state_of
from .vlm_calls import vlm_call, with_images


async def vlm_messages_call(
    request: Request,
    body: InputsRequest,
    conversation: Conversation,
    *,
    normalize: bool | None,
    pooling: str | None,
    dimensions: int | None,
) -> EngineCall:
    """The engine work of ``conversation`` (``body.messages``) for a vision-language embedder
    (``page_retrievers.vlm_family``), its remote images fetched once every check of the request
    and of its template options has passed."""
    model = model_of(request)
    retriever = page_retriever(model)
    prompt = None
    if retriever is not None:
        _refuse_template_options(body, retriever)
        _query_or_page(conversation, retriever)  # its shape, before anything is fetched
    else:
        given = "add_special_tokens" in body.model_fields_set  # vLLM's chat default: false
        prompt = ChatPrompt(
            conversation,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            template_kwargs=dict(body.chat_template_kwargs or {}),
            add_special_tokens=body.add_special_tokens if given else False,
        )
        _check_template_options(model, prompt)
    images = await fetched(request, [p.image for p in conversation.images], PARAM)
    conversation = with_images(conversation, images)
    options = {
        "pooling": pooling,
        "dimensions": dimensions,
        "normalize": normalize,
        "truncate_prompt_tokens": body.truncate_prompt_tokens,
        "truncation_side": body.truncation_side or "right",
        "long_inputs": body.long_inputs,
    }
    item: dict | ChatPrompt
    if prompt is None:
        item = _query_or_page(conversation, retriever or "")
    else:
        item = replace(prompt, conversation=conversation)
    return vlm_call(state_of(request).settings, model, [item], PARAM, [PARAM], options)


def _check_template_options(model: ServedModel, prompt: ChatPrompt) -> None:
    """The engine's own check of a conversation's template options (``check_chat_prompt``: a
    variable the template does not read, options that do not go together), made here so that a
    refused request fetches no image."""
    try:
        folder = Path(model.front.engine.info.model_path)
        check_chat_prompt(prompt, folder)
    except PipepoolError as exc:  # a refusal, or the model loading
        raise from_engine(exc) from None


def _query_or_page(conversation: Conversation, retriever: str) -> dict:
    """A page retriever's input of a conversation: one message of one text (a query) or one image (a
    page), as its processor takes them; 400 for anything else."""
    parts = [p for m in conversation.messages for p in m.parts]
    if len(conversation.messages) != 1 or len(parts) != 1:
        raise APIError(
            400,
            f"messages holds {len(conversation.messages)} messages of {len(parts)} parts; "
            f"{retriever} embeds a query (one text part) or a page (one image_url part) per "
            "request, in its processor's formats (it renders no chat template)",
            param=PARAM,
            code="invalid_value",
        )
    part = parts[0]
    return {"image": part.image} if isinstance(part, ImagePart) else {"text": part.text}


def _refuse_template_options(body: InputsRequest, retriever: str) -> None:
    """A page retriever renders no chat template: the options of one are refused by name."""
    given = {
        "add_generation_prompt": body.add_generation_prompt,
        "continue_final_message": body.continue_final_message,
        "chat_template_kwargs": body.chat_template_kwargs,
        "add_special_tokens": "add_special_tokens" in body.model_fields_set or None,
    }
    for name, value in given.items():
        if value:
            raise APIError(
                400,
                f"{name} is not taken for {retriever}: it renders no chat template (a query or a "
                "page is formatted as its processor formats it)",
                param=name,
                code="invalid_value",
            )
