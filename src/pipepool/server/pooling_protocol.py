"""vLLM's ``POST /pooling``: its request, its answer, and its tasks as pipepool's models do them.

vLLM names what a pooling model computes by ``task``: ``embed`` (one pooled vector per
input, what ``/v1/embeddings`` gives), ``token_embed`` (one vector per token), ``classify``
(one row of label probabilities per input) and ``token_classify`` (one per token). A request
that leaves ``task`` out gets the model's own task, chosen as vLLM chooses it: a token
classifier's ``token_classify``, else the first the model does of ``embed``, ``classify``,
``token_embed``, ``token_classify``."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field

from .protocol import InputsRequest, Usage

# Every task vLLM's /pooling names (``vllm.tasks.PoolingTask``); pipepool does the first four.
PoolingTask = Literal[
    "embed", "classify", "token_embed", "token_classify", "plugin", "embed&token_classify"
]
# What each of pipepool's tasks (``api.router.TASKS``) does of vLLM's, in vLLM's order of
# preference for a request without ``task``.
TASKS_OF = {
    "embed": ("embed", "token_embed"),
    "classify": ("classify",),
    "classify_tokens": ("token_classify",),
}
_PREFERENCE = ("token_classify", "embed", "classify", "token_embed")
# The tasks that normalize applies to: those whose outputs are embeddings.
EMBEDDING_TASKS = ("embed", "token_embed")


def pooling_tasks(model_tasks: tuple[str, ...]) -> tuple[str, ...]:
    """vLLM's tasks a model does, in vLLM's order of preference (the first is its default),
    from what it does (``api.router.TASKS``)."""
    done = {t for task in model_tasks for t in TASKS_OF.get(task, ())}
    return tuple(t for t in _PREFERENCE if t in done)


class PoolingRequest(InputsRequest):
    """vLLM's ``/pooling`` body: the inputs, what to compute of them (``task``), and how."""

    task: PoolingTask | None = Field(
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
