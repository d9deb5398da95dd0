"""vLLM's chat-style embedding input: a request's ``messages`` (OpenAI's chat messages, which
vLLM's ``/v1/embeddings`` and ``/pooling`` take in place of ``input``) read into one
``Conversation`` (``intake/conversation.py``), every image part's URI read as the engine takes
it (``routes/images.py``: data URIs, ``file://`` under ``--allowed-local-media-path``).

What is taken: messages of role system, user or assistant with ``role`` and ``content`` only;
content a string, or a list of ``{"type": "text", "text"}`` and ``{"type": "image_url",
"image_url": {"url", "detail"}}`` parts (``detail`` auto only: low and high are OpenAI's own
resizing). Anything else (another part type, a message field such as ``name`` or
``tool_calls``, another role) is a 400 naming it and where it is, never dropped."""

from __future__ import annotations

from typing import Any

from ..intake.conversation import ChatMessage, Conversation, ImagePart, TextPart
from .errors import APIError
from .routes.images import image_from_uri

PARAM = "messages"
ROLES = ("system", "user", "assistant")
PART_TYPES = ("text", "image_url")


def parse_messages(messages: list[Any]) -> Conversation:
    """The conversation ``messages`` holds; 400 (field ``messages``) naming the first thing
    it holds that is not taken."""
    if not messages:
        _refuse("messages is empty: send at least one message")
    return Conversation(tuple(_message(m, f"messages[{i}]") for i, m in enumerate(messages)))


def _message(message: Any, where: str) -> ChatMessage:
    if not isinstance(message, dict):
        _refuse(f"{where} is not a message object ({{role, content}})")
    stray = sorted(set(message) - {"role", "content"})
    if stray:
        _refuse(
            f"{where}.{stray[0]} is not taken: a message here is its role and content "
            "(tools, names and reasoning change nothing an embedding is computed from)"
        )
    role = message.get("role")
    if role not in ROLES:
        _refuse(f"{where}.role {role!r} is not taken; one of {', '.join(ROLES)}")
    content = message.get("content")
    if isinstance(content, str):
        return ChatMessage(role, (TextPart(content, f"{where}.content"),))
    if not isinstance(content, list) or not content:
        _refuse(f"{where}.content must be a string or a non-empty list of parts")
    parts = tuple(_part(p, f"{where}.content[{j}]") for j, p in enumerate(content))
    return ChatMessage(role, parts)


def _part(part: Any, where: str) -> TextPart | ImagePart:
    if not isinstance(part, dict):
        _refuse(f"{where} is not a content part object ({{type, ...}})")
    kind = part.get("type")
    if kind not in PART_TYPES:
        _refuse(
            f"{where}.type {kind!r} is not taken: parts here are text and image_url "
            "(no audio, video, files or precomputed embeddings)"
        )
    stray = sorted(set(part) - {"type", kind})
    if stray:
        _refuse(f"{where}.{stray[0]} is not taken: a {kind} part is its type and {kind}")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            _refuse(f"{where}.text must be a string")
        return TextPart(text, f"{where}.text")
    image = part.get("image_url")
    if not isinstance(image, dict) or not isinstance(image.get("url"), str):
        _refuse(f"{where}.image_url must be an object with a url (a string)")
    stray = sorted(set(image) - {"url", "detail"})
    if stray:
        _refuse(f"{where}.image_url.{stray[0]} is not taken; an image_url is its url and detail")
    if image.get("detail", "auto") != "auto":
        _refuse(
            f"{where}.image_url.detail {image['detail']!r} is not taken: low and high are "
            "OpenAI's resizing for its own models; here an image is preprocessed as the "
            "checkpoint's image processor does (detail auto, the default)"
        )
    name = f"{where}.image_url.url"
    return ImagePart(image_from_uri(image["url"], name, PARAM), name)


def _refuse(message: str) -> Any:
    raise APIError(400, message, param=PARAM, code="invalid_value")
