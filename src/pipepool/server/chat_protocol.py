"""The fields of vLLM's chat-style embedding request (its ``EmbeddingChatRequest``, also
``/pooling``'s chat form): ``messages`` in place of ``input``, and the chat options vLLM
declares beside it. ``messages`` is read by ``chat_messages.py`` and embedded by
``routes/chat_embeddings.py``; the chat options that need a chat template (pipepool renders
none: a dual encoder embeds one text or one image) are refused by name when given, each saying
why."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field, StrictBool, WithJsonSchema, field_validator

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
    "pipepool renders no chat template: a dual encoder (CLIP, SigLIP) embeds a message's one "
    "text or one image as it is"
)


class ChatFields(BaseModel):
    """vLLM's chat form of an embedding request: ``messages`` (one input), and its chat
    options, those that would need a chat template refused when given."""

    messages: _Messages | None = Field(
        None,
        description="vLLM's chat form, in place of input: one input given as OpenAI chat "
        "messages, answered as one data item. Parts: text, and image_url with a data URI "
        "(data:image/png;base64,...) or a file:// URI under --allowed-local-media-path. A dual "
        "encoder (CLIP, SigLIP) takes one message holding one text or one image.",
    )
    add_generation_prompt: StrictBool = Field(
        False, description="vLLM's; only false (no chat template is rendered here)."
    )
    continue_final_message: StrictBool = Field(
        False, description="vLLM's; only false (no chat template is rendered here)."
    )
    chat_template: _Refused = Field(None, description="vLLM's; refused: " + _NO_TEMPLATE + ".")
    chat_template_kwargs: _Refused = Field(
        None, description="vLLM's; refused: " + _NO_TEMPLATE + "."
    )
    mm_processor_kwargs: _Refused = Field(
        None,
        description="vLLM's; refused: images are preprocessed as the checkpoint's image "
        "processor config says, with no per-request overrides.",
    )
    media_io_kwargs: _Refused = Field(
        None, description="vLLM's; refused: images are decoded with the server's limits only."
    )

    @field_validator("add_generation_prompt", "continue_final_message")
    @classmethod
    def _only_false(cls, value: bool) -> bool:
        if value:
            raise ValueError(f"only false is taken: {_NO_TEMPLATE}")
        return value

    @field_validator("chat_template", "chat_template_kwargs")
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
