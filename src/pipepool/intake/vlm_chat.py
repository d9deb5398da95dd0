"""A conversation as one input of a vision-language embedder (vLLM's chat form of an embedding
request): its messages rendered by the model's chat template as vLLM renders them for an
embedding model. Each message's content is a list of parts in order (a string content is one
text part), a text part ``{"type": "text", "text": ...}`` and an image part ``{"type":
"image"}`` (vLLM's "openai" content format, which Qwen2-VL's templates iterate); the template
gets ``add_generation_prompt`` and the request's ``chat_template_kwargs``;
``continue_final_message`` cuts the rendering right after the final message's last text, as
transformers' ``apply_chat_template`` does (vLLM calls it). Torch-free."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidInputError
from .conversation import ChatMessage, Conversation, ImagePart, ImageSource, TextPart

# Template variables a request's chat_template_kwargs may not set: each is set here, from the
# conversation or from a field of its own.
RESERVED_KWARGS = (
    "messages", "add_generation_prompt", "continue_final_message", "chat_template", "tokenize",
    "tools", "documents",
)  # fmt: skip
# transformers' marker for the end of the final message (continue_final_message).
_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatPrompt:
    """One input given as a conversation, rendered by the model's chat template (module doc).
    ``add_special_tokens``: the tokenizer's special tokens added on top of the rendering
    (vLLM's chat default: false, the template writes them). Its images (``images``) are bytes
    or files, in the order the conversation holds them; remote ones are fetched before."""

    conversation: Conversation
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    add_special_tokens: bool = False

    @property
    def images(self) -> list[ImageSource]:
        return [part.image for part in self.conversation.images]

    @classmethod
    def from_messages(cls, messages: Sequence[Mapping[str, Any]], **options: Any) -> ChatPrompt:
        """The Python form of vLLM's chat form: ``messages`` of ``{"role", "content"}`` (role
        system, user or assistant), a content a string or a list of ``{"type": "text",
        "text"}`` and ``{"type": "image", "image"}`` parts (a PIL image, bytes or a
        ``pathlib.Path``); ``options`` are the fields (``add_generation_prompt``, ...).
        InvalidInputError (param ``input``) naming what is not taken."""
        if isinstance(messages, (str, Mapping)) or not messages:
            _refuse("messages", "a non-empty list of messages")
        return cls(Conversation(tuple(_message(m, i) for i, m in enumerate(messages))), **options)


def check_chat_options(prompt: ChatPrompt, template_variables: set[str]) -> None:
    """InvalidInputError (naming the option) for options the rendering cannot honour: both
    ``add_generation_prompt`` and ``continue_final_message`` (as vLLM refuses), and a
    ``chat_template_kwargs`` key that is reserved or that the template does not read (it would
    change nothing)."""
    if prompt.add_generation_prompt and prompt.continue_final_message:
        raise InvalidInputError(
            "add_generation_prompt and continue_final_message cannot both be true: the first "
            "opens a new assistant message, the second leaves the final one open",
            param="continue_final_message",
        )
    for key in prompt.template_kwargs:
        if key in RESERVED_KWARGS:
            raise InvalidInputError(
                f"chat_template_kwargs.{key} is not taken: it is set from the request's own "
                "fields and messages",
                param="chat_template_kwargs",
            )
        if key not in template_variables:
            raise InvalidInputError(
                f"chat_template_kwargs.{key}: the model's chat template reads no variable "
                f"{key!r}, so it would change nothing; the template reads "
                f"{', '.join(sorted(template_variables - set(RESERVED_KWARGS))) or 'none'}",
                param="chat_template_kwargs",
            )
    if prompt.continue_final_message and not _final_text(prompt.conversation):
        raise InvalidInputError(
            "continue_final_message: the final message has no text part to continue",
            param="continue_final_message",
        )


def template_messages(conversation: Conversation) -> list[dict]:
    """The conversation as the template's ``messages`` (vLLM's openai content format)."""
    return [
        {
            "role": message.role,
            "content": [
                {"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
                for p in message.parts
            ],
        }
        for message in conversation.messages
    ]


def render_chat(template, prompt: ChatPrompt, index: int) -> str:
    """The rendering of ``prompt`` by ``template`` (a compiled jinja template), its options
    checked before (``check_chat_options``)."""
    messages = template_messages(prompt.conversation)
    final = None
    if prompt.continue_final_message:  # transformers' way: mark the final text, cut there
        final = _final_text(prompt.conversation)
        block = next(b for b in reversed(messages[-1]["content"]) if "text" in b)
        block["text"] += _TAG
    rendered = template.render(
        **prompt.template_kwargs,
        messages=messages,
        tools=None,
        documents=None,
        add_generation_prompt=prompt.add_generation_prompt,
    )
    if final is None:
        return rendered
    if final.strip() not in rendered or _TAG.strip() not in rendered:
        raise InvalidInputError(
            f"input {index}: continue_final_message: the chat template does not write the "
            "final message's text as it is, so there is no place to continue it from",
            param="input",
            index=index,
        )
    at = rendered.rindex(_TAG.strip())
    return rendered[:at] if rendered[at : at + len(_TAG)] == _TAG else rendered[:at].rstrip()


def _final_text(conversation: Conversation) -> str | None:
    texts = [p for p in conversation.messages[-1].parts if not isinstance(p, ImagePart)]
    return texts[-1].text if texts else None


def _message(message: Any, i: int) -> ChatMessage:
    where = f"messages[{i}]"
    if not isinstance(message, Mapping) or set(message) != {"role", "content"}:
        _refuse(where, "a message of role and content")
    if message["role"] not in _ROLES:
        _refuse(f"{where}.role", f"one of {', '.join(_ROLES)}")
    content = message["content"]
    if isinstance(content, str):
        return ChatMessage(message["role"], (TextPart(content, f"{where}.content"),))
    if not isinstance(content, Sequence) or not content:
        _refuse(f"{where}.content", "a string or a non-empty list of parts")
    return ChatMessage(message["role"], tuple(
        _part(part, f"{where}.content[{j}]") for j, part in enumerate(content)
    ))  # fmt: skip


def _part(part: Any, where: str) -> TextPart | ImagePart:
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind == "text" and set(part) == {"type", "text"} and isinstance(part["text"], str):
        return TextPart(part["text"], where)
    if kind == "image" and set(part) == {"type", "image"}:
        return ImagePart(part["image"], where)  # decoded, or refused, with the call's images
    return _refuse(where, '{"type": "text", "text": str} or {"type": "image", "image": image}')


def _refuse(where: str, what: str) -> Any:
    raise InvalidInputError(f"{where} must be {what}", param="input")
