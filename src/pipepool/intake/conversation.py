"""One input given as chat messages (vLLM's chat-style embedding request): its messages in
order, each a role and its parts, a part a text or an image. Neutral: what a model makes of a
conversation is its own rule. A dual encoder (CLIP, SigLIP) embeds one text or one image
(``single_input``); a vision-language embedder would render the whole conversation through its
chat template, images at their placeholders. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidInputError


@dataclass(frozen=True)
class RemoteImage:
    """An http(s) image URL, not fetched yet: the server fetches it from the hosts it allows
    (``server/media_fetch.py``) before the engine sees its bytes."""

    url: str
    where: str  # the request field it came from, for errors


# An image as a request gives it: its bytes (a data URI's), a file (a file:// URI's path, read
# only under allowed_local_media_path), or a remote URL to fetch.
ImageSource = bytes | Path | RemoteImage


@dataclass(frozen=True)
class TextPart:
    """A text part of a message (a string content is one such part)."""

    text: str
    where: str  # the request field it came from, for errors: "messages[0].content[1].text"


@dataclass(frozen=True)
class ImagePart:
    """An image part of a message, as the engine takes it."""

    image: ImageSource
    where: str  # "messages[0].content[0].image_url.url"


@dataclass(frozen=True)
class ChatMessage:
    """One message: its role (system, user, assistant) and its parts, in order."""

    role: str
    parts: tuple[TextPart | ImagePart, ...]


@dataclass(frozen=True)
class Conversation:
    """One input given as messages; ``texts`` and ``images`` are its parts of each kind, in
    order (a model's chat template places them; the engine's image limits still apply)."""

    messages: tuple[ChatMessage, ...]

    @property
    def parts(self) -> list[TextPart | ImagePart]:
        return [part for message in self.messages for part in message.parts]

    @property
    def texts(self) -> list[TextPart]:
        return [p for p in self.parts if isinstance(p, TextPart)]

    @property
    def images(self) -> list[ImagePart]:
        return [p for p in self.parts if isinstance(p, ImagePart)]

    def single_input(self, model: str) -> str | ImageSource:
        """What a dual encoder (``model``, its architecture) embeds of this conversation: its
        one message's one part, a text or an image (vLLM's CLIP and SigLIP take text-only or
        image-only prompts, one image each). InvalidInputError (param ``messages``) for
        anything else, naming where: such a model has no chat template to join parts with, and
        its towers embed one modality each."""
        why = (
            f"{model} is a dual encoder: it embeds one text or one image per input, so "
            "messages must be one message holding one text part or one image_url part"
        )
        if len(self.messages) != 1:
            raise InvalidInputError(
                f"messages holds {len(self.messages)} messages; {why}", param="messages"
            )
        parts = self.messages[0].parts
        if len(parts) != 1:
            kinds = sorted({"text" if isinstance(p, TextPart) else "image_url" for p in parts})
            raise InvalidInputError(
                f"messages[0].content holds {len(parts)} parts ({' and '.join(kinds)}); {why} "
                "(send each as an input of its own)",
                param="messages",
            )
        part = parts[0]
        return part.text if isinstance(part, TextPart) else part.image
