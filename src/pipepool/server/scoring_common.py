"""The request fields vLLM's pooling requests share (its ``PoolingBasicRequestMixin``), as the
scoring routes take them: each honoured with vLLM's meaning or refused by name with the reason.

- ``user``: the caller's end-user id; vLLM records it nowhere, nor does this server.
- ``request_id``: the answer's ``id`` becomes ``<route>-<request_id>`` (vLLM's random id
  otherwise).
- ``priority``: this server schedules no request before another by a number (clients take
  turns); 0, vLLM's and Cohere's default and highest priority, is what every request gets.
  vLLM refuses any other value on a model without priority scheduling, and so does this.
- ``cache_salt``: salts vLLM's prefix cache so that requests of different users share no
  cached tokens. This server caches no prompt tokens across requests, so the isolation it asks
  for always holds; it is checked as vLLM checks it (1 to 1024 characters).
- ``padding``: "do_not_pad" is what every prompt gets; "max_length" (pad every prompt to
  max_model_len, for models trained without an attention mask) is refused.
- ``mm_processor_kwargs``: options of a multimodal processor; text-only models have none.
- ``truncation_side``: which end a truncated prompt loses tokens from ("right": it keeps its
  first tokens; "left": its last), whether the request's ``truncate_prompt_tokens`` or the
  server's policy truncates it.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import Field, StrictStr, field_validator

from .openapi import Integer
from .protocol import _Strict

TruncationSide = Literal["right", "left"]


class VllmPoolingFields(_Strict):
    """vLLM's fields common to ``/score``, ``/rerank`` and ``/classify`` (module docstring:
    what each does here)."""

    user: StrictStr | None = Field(None, description="The end-user's id (recorded nowhere).")
    request_id: StrictStr | None = Field(
        None, description="The answer's id becomes <route>-<request_id> (vLLM's)."
    )
    priority: Integer | None = Field(
        None, description="0 only: this server schedules by client turns, not by a number."
    )
    cache_salt: StrictStr | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="Accepted: no prompt tokens are cached across requests here, so no "
        "request shares any with another.",
    )
    padding: Literal["do_not_pad", "max_length"] | None = Field(
        None, description='"do_not_pad" (what every prompt gets); "max_length" is refused.'
    )
    mm_processor_kwargs: dict[str, Any] | None = Field(
        None, description="Refused: the models served here read text only."
    )
    truncation_side: TruncationSide | None = Field(
        None,
        description="Which end a truncated prompt loses tokens from: right (keeps the first "
        "tokens; the default) or left (keeps the last).",
    )

    @field_validator("priority")
    @classmethod
    def _no_priority_scheduling(cls, value: int | None) -> int | None:
        if value not in (None, 0):
            raise ValueError(
                f"priority {value} asks for priority scheduling, which this server does not do "
                "(each client's requests take turns): send 0 or leave it out"
            )
        return value

    @field_validator("padding")
    @classmethod
    def _no_padding(cls, value: str | None) -> str | None:
        if value == "max_length":
            raise ValueError(
                'padding "max_length" pads prompts to max_model_len for models trained without '
                "an attention mask; the models served here attend to their tokens only: send "
                '"do_not_pad" or leave it out'
            )
        return value

    @field_validator("mm_processor_kwargs")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            raise ValueError("mm_processor_kwargs configures a multimodal processor; the models "
                             "served here read text only")  # fmt: skip
        return value

    def answer_id(self, route: str) -> str:
        """The answer's ``id``: ``<route>-<request_id>``, or a random one."""
        return f"{route}-{self.request_id if self.request_id is not None else uuid.uuid4().hex}"
