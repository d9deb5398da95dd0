"""The chat form of ``/v1/embeddings`` and ``/pooling`` (vLLM's ``messages``): the body's one
conversation (``chat_messages.py``) embedded as one input, answered as one data item in the
route's usual answer.

A dual encoder (CLIP, SigLIP) embeds the conversation's one text through its text tower (as
``input`` would: the same vectors, the same truncation options) or its one image through its
vision tower (as Cohere's ``images`` would); anything else in it is a 400 saying so
(``Conversation.single_input``). Other models are refused: pipepool renders no chat template,
and a vision-language embedder's rendering of a conversation is not wired here yet."""

from __future__ import annotations

from fastapi import Request, Response

from ...core.dual_encoders import DUAL_ENCODERS
from ...errors import PipepoolError
from ...intake.conversation import RemoteImage
from ..chat_messages import PARAM, parse_messages
from ..errors import APIError, from_engine
from ..front import Encoded
from ..media_fetch import fetched
from ..protocol import InputsRequest
from .images import renamed, run_model_images
from .shared import model_of, run_model_outputs


async def embed_messages(
    request: Request,
    body: InputsRequest,
    *,
    normalize: bool | None,
    pooling: str | None = None,
    dimensions: int | None = None,
) -> Encoded | Response:
    """The vectors of ``body.messages`` (one input), with the route's ``pooling`` ("all":
    /pooling's token_embed), ``dimensions`` and ``normalize``; a bare Response (499) if the
    client left meanwhile."""
    assert body.messages is not None  # the caller's test
    if body.input is not None:
        raise APIError(400, "give input or messages, not both", param=PARAM, code="invalid_value")
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
            f"messages are taken for dual encoders ({', '.join(DUAL_ENCODERS)}) here; this "
            f"model ({architecture}) takes input (pipepool renders no chat template)",
            param=PARAM,
            code="invalid_value",
        )
    conversation = parse_messages(body.messages)
    try:
        item = conversation.single_input(architecture)
    except PipepoolError as exc:
        raise from_engine(exc) from None
    part = conversation.parts[0]
    if isinstance(item, str):
        try:
            return await run_model_outputs(
                request,
                [item],
                param=PARAM,
                truncate_prompt_tokens=body.truncate_prompt_tokens,
                truncation_side=body.truncation_side or "right",
                long_inputs=body.long_inputs,
                pooling=pooling,
                dimensions=dimensions,
                normalize=normalize,
            )
        except APIError as exc:
            raise renamed(exc, PARAM, [part.where]) from None
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
    return await run_model_images(
        request,
        [item],
        PARAM,
        [part.where],
        dimensions=dimensions,
        normalize=normalize,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
        truncation_side=body.truncation_side or "right",
        long_inputs=body.long_inputs,
    )
