"""A request as the driver sees it: prompt tokens, what to pool, how far it got."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np


class RequestStatus(IntEnum):
    """Ordered: ``status >= FINISHED`` means the request will not be scheduled again."""

    WAITING = 0  # queued, holds no KV blocks
    RUNNING = 1  # admitted: holds KV blocks, some chunks not yet scheduled
    SCHEDULED = 2  # every chunk is in a plan; waiting for the last stage's result
    FINISHED = 3
    ABORTED = 4

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED


@dataclass(frozen=True)
class PoolingParams:
    """What the last stage computes for a request, and what the driver applies on top."""

    pooling: str  # last | mean | cls | all (token embeddings)
    normalize: bool = False  # L2 after Matryoshka truncation (per token for "all")
    dimensions: int | None = None  # Matryoshka: keep the first `dimensions` components


@dataclass(eq=False)
class Request:
    request_id: int
    token_ids: np.ndarray  # [prompt_len] int64
    params: PoolingParams
    status: RequestStatus = RequestStatus.WAITING
    # Tokens handed to plans so far; the next chunk starts here. Ahead of num_computed_tokens
    # while chunks are in the pipeline.
    num_scheduled_tokens: int = 0
    # Tokens the last stage confirmed (from its post-step digest).
    num_computed_tokens: int = 0
    block_ids: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32))
    output: np.ndarray | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.token_ids)
