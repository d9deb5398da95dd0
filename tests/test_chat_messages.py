"""vLLM's chat form read into the neutral ``Conversation`` (no server): every message and part
in order with where it came from, images as the engine takes them, and everything not taken
refused naming where it is; a dual encoder's rule (one message, one part) on top."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from pipepool.errors import InvalidInputError
from pipepool.intake.conversation import ImagePart, RemoteImage, TextPart
from pipepool.server.chat_messages import parse_messages
from pipepool.server.errors import APIError

PNG = b"\x89PNG\r\n\x1a\n-not-decoded-here"
URI = "data:image/png;base64," + base64.b64encode(PNG).decode()


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_a_conversation_keeps_every_part_in_order_with_its_place():
    conversation = parse_messages([
        {"role": "system", "content": "Represent the image."},
        {"role": "user", "content": [_image(URI), {"type": "text", "text": "a cat"},
                                     _image("file:///data/dog.png"),
                                     _image("https://example.com/bird.png")]},
    ])  # fmt: skip
    assert [m.role for m in conversation.messages] == ["system", "user"]
    parts = conversation.parts
    assert parts[0] == TextPart("Represent the image.", "messages[0].content")
    assert parts[1] == ImagePart(PNG, "messages[1].content[0].image_url.url")
    assert parts[2] == TextPart("a cat", "messages[1].content[1].text")
    assert parts[3].image == Path("/data/dog.png")
    assert parts[4].image == RemoteImage(
        "https://example.com/bird.png", "messages[1].content[3].image_url.url"
    )
    assert [p.text for p in conversation.texts] == ["Represent the image.", "a cat"]
    assert len(conversation.images) == 3


def test_a_dual_encoder_takes_one_message_of_one_part():
    assert parse_messages([{"role": "user", "content": "a cat"}]).single_input("M") == "a cat"
    one_image = parse_messages([{"role": "user", "content": [_image(URI)]}])
    assert one_image.single_input("M") == PNG
    two = parse_messages([{"role": "user", "content": [_image(URI), _image(URI)]}])
    with pytest.raises(InvalidInputError, match=r"holds 2 parts \(image_url\); M is a dual"):
        two.single_input("M")
    system = parse_messages([{"role": "system", "content": "x"}, {"role": "user", "content": "y"}])
    with pytest.raises(InvalidInputError, match="messages holds 2 messages"):
        system.single_input("M")


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        ([], "messages is empty"),
        (["hi"], "messages[0] is not a message object"),
        ([{"role": "user", "content": "a", "tool_calls": []}], "messages[0].tool_calls is not"),
        ([{"role": "developer", "content": "a"}], "messages[0].role 'developer' is not taken"),
        ([{"role": "user", "content": None}], "messages[0].content must be a string or"),
        ([{"role": "user", "content": [{"type": "video_url"}]}],
         "messages[0].content[0].type 'video_url' is not taken"),
        ([{"role": "user", "content": [{"type": "text", "text": "a", "uuid": "x"}]}],
         "messages[0].content[0].uuid is not taken: a text part is its type and text"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "text must be a string"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}],
         "image_url must be an object with a url"),
        ([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": URI, "size": 3}}]}],
         "image_url.size is not taken"),
        ([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": URI, "detail": "low"}}]}],
         "image_url.detail 'low' is not taken"),
        ([{"role": "user", "content": [_image("ftp://x/cat.png")]}],
         "messages[0].content[0].image_url.url is not a base64 data URI"),
        ([{"role": "user", "content": [_image("data:text/plain;base64,AAAA")]}],
         "has media type 'text/plain'"),
    ],
)  # fmt: skip
def test_what_is_not_taken_is_refused_naming_where(messages, says):
    with pytest.raises(APIError) as caught:
        parse_messages(messages)
    assert caught.value.status == 400 and caught.value.param == "messages"
    assert says in caught.value.message
