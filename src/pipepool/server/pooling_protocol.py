"""vLLM's ``POST /pooling``: its request and its answer (its tasks: ``pooling_tasks.py``)."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, Field, StrictStr

from .openapi import BOUNDED_BY
from .pooling_tasks import POOLING_TASKS
from .protocol import InputsRequest, Usage


class PoolingRequest(InputsRequest):
    """vLLM's ``/pooling`` body: the inputs, what to compute of them (``task``), and how."""

    task: (
        Annotated[
            StrictStr, Field(json_schema_extra={"enum": list(POOLING_TASKS), BOUNDED_BY: "tasks"})
        ]
        | None
    ) = Field(
        None,
        description="What to compute: embed (one vector per input), token_embed (one per "
        "token), classify (label probabilities per input), token_classify (per token). "
        "Default: the model's task (a token classifier's token_classify, else the first it "
        "does of embed, classify, token_embed). A task the model cannot do is a 400 naming "
        "those it can.",
    )


class PoolingData(BaseModel):
    """One input's output: a vector (embed, classify) or a matrix ``[num_tokens, n]``
    (token_embed, token_classify); base64: its row-major bytes of ``embed_dtype``."""

    object: Literal["pooling"] = "pooling"
    index: int
    data: list[float] | list[list[float]] | str


class PoolingResponse(BaseModel):
    """vLLM's ``/pooling`` answer: one ``PoolingData`` per input, in input order, under the
    request's ``id`` and the time it was answered (``created``, Unix seconds)."""

    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[PoolingData]
    usage: Usage


def answer_head(prefix: str) -> dict:
    """A new answer's ``id`` (``prefix``, then a random hex) and ``created``, as vLLM's
    ("pooling-...", "embd-...")."""
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time())}
