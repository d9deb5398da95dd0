"""The chat form of ``/v1/embeddings`` and ``/pooling`` (vLLM's ``messages``): the body's one
conversation (``chat_messages.py``) embedded as one input, answered as one data item in the
route's usual answer.

A vision-language embedder renders the whole conversation with its chat template
(``vlm_messages.py``). A dual encoder (CLIP, SigLIP) embeds the conversation's one text through
its text tower (as ``input`` would: the same vectors, the same truncation options) or its one
image through its vision tower (as Cohere's ``images`` would); anything else in it is a 400
saying so (``Conversation.single_input``), and refuses the chat template's options by name.
Other models are refused: a text model's chat template is not rendered here."""

from __future__ import annotations

from dataclasses import replace

from fastapi import Request, Response

from ...core.dual_encoders import DUAL_ENCODERS
from ...errors import PipepoolError
from ...intake.conversation import RemoteImage
from ..chat_messages import PARAM, parse_messages
from ..errors import APIError, from_engine
from ..front import Encoded, EngineCall
from ..limits import embedding_call
from ..media_fetch import fetched
from ..protocol import InputsRequest
from .images import images_call, renamed
from .page_retrievers import vlm_family
from .shared import check_task, model_of, run_engine, state_of
from .vlm_messages import vlm_messages_call


async def embed_messages(
    request: Request,
    body: InputsRequest,
    *,
    normalize: bool | None,
    pooling: str | None = None,
    dimensions: int | None = None,
) -> Encoded | Response:
    """The vectors of ``body.messages`` (``messages_call``, run); a bare Response (499) if the
    client left meanwhile."""
    work = await messages_call(
        request, body, normalize=normalize, pooling=pooling, dimensions=dimensions
    )
    return await run_engine(request, work)


async def messages_call(
    request: Request,
    body: InputsRequest,
    *,
    normalize: bool | None,
    pooling: str | None = None,
    dimensions: int | None = None,
) -> EngineCall:
    """The engine work of ``body.messages`` (one input), with the route's ``pooling`` ("all":
    /pooling's token_embed), ``dimensions`` and ``normalize``, every check made (a remote
    image fetched first)."""
    assert body.messages is not None  # the caller's test
    if body.input is not None:
        raise APIError(400, "give input or messages, not both", param=PARAM, code="invalid_value")
    conversation = parse_messages(body.messages)
    if vlm_family(model_of(request)) is not None:
        return await vlm_messages_call(
            request, body, conversation, normalize=normalize, pooling=pooling,
            dimensions=dimensions,
        )  # fmt: skip
    if "add_special_tokens" in body.model_fields_set:
        raise APIError(
            400,
            "add_special_tokens is not taken with messages: a dual encoder's text is embedded "
            "as its tokenizer makes it (special tokens included), as input's texts are; "
            "there is no chat template to add them to",
            param="add_special_tokens",
            code="invalid_value",
        )
    try:
        architecture = model_of(request).front.engine.info.architecture
    except PipepoolError as exc:  # loading, or failed to start
        raise from_engine(exc) from None
    if architecture not in DUAL_ENCODERS:
        raise APIError(
            400,
            f"messages are taken for dual encoders ({', '.join(DUAL_ENCODERS)}) and "
            "vision-language embedders (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, ColQwen2, ColPali) "
            f"here; this model ({architecture}) takes input",
            param=PARAM,
            code="invalid_value",
        )
    refuse_template_options(body, architecture)
    try:
        item = conversation.single_input(architecture)
    except PipepoolError as exc:
        raise from_engine(exc) from None
    part = conversation.parts[0]
    model, settings = model_of(request), state_of(request).settings
    if isinstance(item, str):
        check_task(model, "embed")
        options = {
            "truncate_prompt_tokens": body.truncate_prompt_tokens,
            "truncation_side": body.truncation_side or "right",
            "long_inputs": body.long_inputs,
            "pooling": pooling,
            "dimensions": dimensions,
            "normalize": normalize,
        }
        name = [part.where]
        try:
            work = embedding_call(settings, model.front, [item], options, PARAM)
        except APIError as exc:
            raise renamed(exc, PARAM, name) from None
        return replace(work, renamed=lambda exc: renamed(exc, PARAM, name))
    if pooling == "all":
        raise APIError(
            400,
            "task token_embed gives a text's token vectors; an image gives its pooled vector "
            "only (task embed)",
            param="task",
            code="invalid_value",
        )
    if isinstance(item, RemoteImage):
        item = (await fetched(request, [item], PARAM))[0]
    options = {
        "dimensions": dimensions,
        "normalize": normalize,
        "truncate_prompt_tokens": body.truncate_prompt_tokens,
        "truncation_side": body.truncation_side or "right",
        "long_inputs": body.long_inputs,
    }
    return images_call(settings, model, [item], PARAM, [part.where], options)


def refuse_template_options(body: InputsRequest, architecture: str) -> None:
    """A dual encoder renders no chat template: the options of one are refused by name."""
    given = {
        "add_generation_prompt": body.add_generation_prompt,
        "continue_final_message": body.continue_final_message,
        "chat_template_kwargs": body.chat_template_kwargs,
    }
    for name, value in given.items():
        if value:
            raise APIError(
                400,
                f"{name} is not taken for {architecture}: a dual encoder renders no chat "
                "template (it embeds a message's one text or one image as it is)",
                param=name,
                code="invalid_value",
            )
