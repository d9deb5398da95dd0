"""Cohere v2's ``inputs`` (content parts, texts and images mixed in one input) and a
vision-language embedder's ``images`` on ``POST /v2/embed``. An input of content parts is one
user message of its parts in order, rendered by the model's chat template with the generation
prompt (``intake/vlm_chat.py``): exactly how ``Engine.embed`` renders a dict input (its images,
then its text), so ``{"content": [image, text]}`` gets the vector of ``{"text", "image"}``; an
image of ``images`` is the dict input ``{"image": ...}``."""

from __future__ import annotations

from pathlib import Path

from fastapi import Request, Response

from ...api.vlm import CHAT_FAMILIES
from ...intake.conversation import ChatMessage, Conversation, ImagePart, TextPart
from ...intake.vlm_chat import ChatPrompt
from .. import cohere_protocol as cp
from ..errors import APIError
from ..front import Encoded
from ..media_fetch import fetched
from .images import image_from_uri
from .page_retrievers import vlm_family
from .shared import model_of, run_engine, state_of
from .vlm_calls import vlm_call

PARAM = "inputs"


async def embed_inputs(
    request: Request, body: cp.CohereEmbedRequest, dimensions: int | None
) -> Encoded | Response:
    """The vectors of ``body.inputs`` (one per input), its remote images fetched first; a bare
    Response (499) if the client left meanwhile. 400 for a model that is no Qwen2-VL-style
    embedder, and for the texts' options (``truncate``, ``max_tokens``)."""
    assert body.inputs is not None  # the caller's test
    model = model_of(request)
    if vlm_family(model) not in CHAT_FAMILIES:
        raise APIError(
            400,
            "inputs (content parts) need a vision-language embedder (Qwen2-VL, Qwen2.5-VL, "
            f"Qwen3-VL); model {model.name} takes texts, or images with input_type image where "
            "it embeds them",
            param=PARAM,
            code="invalid_value",
        )
    refuse_text_fields(body)
    parts = [_parts(item.content, f"{PARAM}[{i}]") for i, item in enumerate(body.inputs)]
    sources = [p.image for input_parts in parts for p in input_parts if isinstance(p, ImagePart)]
    images = iter(await fetched(request, sources, PARAM))
    prompts = [
        ChatPrompt(
            Conversation((ChatMessage("user", tuple(_fetched(p, images) for p in input_parts)),)),
            add_generation_prompt=True,
            add_special_tokens=True,
        )
        for input_parts in parts
    ]
    names = [f"{PARAM}[{i}]" for i in range(len(prompts))]
    options = {"dimensions": dimensions}
    work = vlm_call(state_of(request).settings, model, prompts, PARAM, names, options)
    return await run_engine(request, work)


async def embed_vlm_images(
    request: Request, blobs: list[bytes | Path], dimensions: int | None
) -> Encoded | Response:
    """A vision-language embedder's vectors of ``images`` (each the dict input ``{"image"}``)."""
    names = [f"images[{i}]" for i in range(len(blobs))]
    items = [{"image": blob} for blob in blobs]
    options = {"dimensions": dimensions}
    work = vlm_call(state_of(request).settings, model_of(request), items, "images", names, options)
    return await run_engine(request, work)


def refuse_text_fields(body: cp.CohereEmbedRequest) -> None:
    """``truncate`` and ``max_tokens`` cut texts; inputs with images are not cut."""
    for name in ("truncate", "max_tokens"):
        if name in body.model_fields_set:
            raise APIError(400, f"{name} applies to texts, not to images or inputs", param=name)


def _parts(content: list[cp.CohereContentPart], where: str) -> list[TextPart | ImagePart]:
    out: list[TextPart | ImagePart] = []
    for j, part in enumerate(content):
        name = f"{where}.content[{j}]"
        if part.image_url is not None:
            uri = part.image_url.url
            out.append(ImagePart(image_from_uri(uri, f"{name}.image_url.url", PARAM), name))
        else:
            assert part.text is not None  # CohereContentPart's validator
            out.append(TextPart(part.text, f"{name}.text"))
    return out


def _fetched(part: TextPart | ImagePart, images) -> TextPart | ImagePart:
    return ImagePart(next(images), part.where) if isinstance(part, ImagePart) else part
