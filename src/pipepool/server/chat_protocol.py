"""The fields of vLLM's chat-style embedding request (its ``EmbeddingChatRequest``, also
``/pooling``'s chat form): ``messages`` in place of ``input``, and the chat options vLLM
declares beside it. ``messages`` is read by ``chat_messages.py`` and embedded by
``routes/chat_embeddings.py``. The chat template's options (``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs``) are taken with messages, for a
vision-language embedder, which renders its chat template (``intake/vlm_chat.py``); a dual
encoder (one text or one image, no template) refuses them by name, and so does a body without
messages. A request's own chat template is refused."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    BaseModel,
    Field,
    StrictBool,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)

from .errors import APIError

# Refused by name when given (not null), so that a client learns why.
_Refused = Annotated[Any, WithJsonSchema({"type": "null"})]
_Messages = Annotated[
    list[Any],
    WithJsonSchema(
        {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "role": {"type": "string", "enum": ["system", "user", "assistant"]},
                    "content": {
                        "anyOf": [
                            {"type": "string"},
                            {"type": "array", "items": {"type": "object"}},
                        ]
                    },
                },
                "required": ["role", "content"],
            },
        }
    ),
]
_NO_TEMPLATE = (
    "a request's own chat template is not taken (vLLM takes one only with "
    "--trust-request-chat-template, which this server does not have): messages are rendered "
    "by the model's chat template"
)
# The chat template's options, which apply to messages only.
TEMPLATE_OPTIONS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")


class ChatFields(BaseModel):
    """vLLM's chat form of an embedding request: ``messages`` (one input), and its chat
    options (module doc): the template's taken with messages only, a request's own template
    refused when given."""

    messages: _Messages | None = Field(
        None,
        description="vLLM's chat form, in place of input: one input given as OpenAI chat "
        "messages, answered as one data item. Parts: text, and image_url with a data URI "
        "(data:image/png;base64,...), a file:// URI under --allowed-local-media-path, or an "
        "http(s) URL of a host --allowed-media-domains names. A dual encoder (CLIP, SigLIP) "
        "takes one message holding one text or one image; a Qwen2-VL / Qwen2.5-VL / Qwen3-VL "
        "embedder the whole conversation, rendered by its chat template; a page retriever "
        "(ColQwen2, ColPali) one message of one text (a query) or one image (a page).",
    )
    add_generation_prompt: StrictBool = Field(
        False,
        description="vLLM's, with messages: the chat template opens an assistant message after "
        "the conversation (a vision-language embedder's; a dual encoder takes only false).",
    )
    continue_final_message: StrictBool = Field(
        False,
        description="vLLM's, with messages: the rendering ends right after the final message's "
        "last text, leaving it open (not with add_generation_prompt).",
    )
    chat_template: _Refused = Field(None, description="vLLM's; refused: " + _NO_TEMPLATE + ".")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="vLLM's, with messages: variables for the model's chat template (each one "
        "the template reads, else refused by name).",
    )
    mm_processor_kwargs: _Refused = Field(
        None,
        description="vLLM's; refused: images are preprocessed as the checkpoint's image "
        "processor config says, with no per-request overrides.",
    )
    media_io_kwargs: _Refused = Field(
        None, description="vLLM's; refused: images are decoded with the server's limits only."
    )

    @field_validator(*TEMPLATE_OPTIONS)
    @classmethod
    def _with_messages(cls, value: Any, info: ValidationInfo) -> Any:
        if value and info.data.get("messages") is None:
            raise ValueError(
                "applies to messages (the model's chat template renders them); this body holds none"
            )
        return value

    @field_validator("chat_template")
    @classmethod
    def _no_template(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(f"not taken: {_NO_TEMPLATE}")
        return value

    @field_validator("mm_processor_kwargs", "media_io_kwargs")
    @classmethod
    def _no_overrides(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(
                "not taken: images are decoded within the server's limits and preprocessed as "
                "the checkpoint's image processor config says, with no per-request overrides"
            )
        return value


def missing_input(has_messages: bool) -> APIError:
    """The 400 of a body without ``input`` where the route or its options take input only
    (``has_messages``: it holds messages instead), or with neither."""
    if has_messages:
        return APIError(
            400,
            "messages are taken for embeddings (/v1/embeddings without outputs or "
            "late_chunking, /pooling's embed and token_embed); this request takes input",
            param="messages",
            code="invalid_value",
        )
    return APIError(
        400,
        "input is required: the texts (or token ids) to embed, or messages (vLLM's chat form)",
        param="input",
        code="invalid_value",
    )
