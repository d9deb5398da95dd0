"""The step contract between the scheduler and the stages (docs/design.md §2).

``Scheduler.schedule() -> StepPlan``; every stage applies the same plan in the same order;
the last stage answers with a ``StepResult``; ``Scheduler.update(plan, result)``.

Everything per request is an array (struct of arrays), so that the cost of building,
sending and applying a plan grows with the number of requests only inside numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from .digest import NUM_PARTS, Digest
from .media import MEDIA_COLUMNS, ImageInput, no_media

_EMPTY_I64 = np.empty(0, dtype=np.int64)


def _empty_i64() -> np.ndarray:
    return _EMPTY_I64


def _no_expectation() -> np.ndarray:
    return np.empty((0, NUM_PARTS), dtype=np.int64)


@dataclass(frozen=True)
class NewRequests:
    """What a stage learns once about each request a plan schedules for the first time."""

    request_ids: np.ndarray  # [N] int64
    prompt_lens: np.ndarray  # [N] int64
    poolings: np.ndarray  # [N] int8 Pooling codes
    normalize: np.ndarray  # [N] bool: L2-normalise the output (per token for ALL)
    dimensions: np.ndarray  # [N] int64 Matryoshka width; 0 keeps every component
    # KV blocks: request i holds block_ids[block_offsets[i]:block_offsets[i+1]], empty unless
    # its prompt spans several steps (only then do later chunks read earlier chunks' K/V).
    block_offsets: np.ndarray  # [N+1] int64
    block_ids: np.ndarray  # [sum] int32
    # Bidirectional models only: request i's keys are its first key_lens[i] tokens (the rest
    # attend but are attended by none: ColBERT's query expansion); 0 = every token. [N] int64,
    # or empty when every token of every request is a key (the usual plan: nothing to send).
    key_lens: np.ndarray = field(default_factory=_empty_i64)
    # Vision-language prompts: request i's images (``core/media.py``), for the first stage's
    # vision tower; empty when no request has one (stripped before other stages get a plan).
    images: tuple[tuple[ImageInput, ...], ...] = ()

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        assert len(self.prompt_lens) == len(self.poolings) == n
        assert len(self.images) in (0, n), "images per new request, or none"
        assert len(self.normalize) == len(self.dimensions) == n
        assert len(self.block_offsets) == n + 1 and self.block_offsets[-1] == len(self.block_ids)
        assert len(self.key_lens) in (0, n)
        if len(self.key_lens):
            inside = (self.key_lens >= 0) & (self.key_lens <= self.prompt_lens)
            assert bool(inside.all()), "a key length outside [0, prompt length]"

    @property
    def has_key_lens(self) -> bool:
        """Whether some request keys only a prefix of its tokens."""
        return bool(len(self.key_lens)) and bool(
            ((self.key_lens > 0) & (self.key_lens < self.prompt_lens)).any()
        )

    def __len__(self) -> int:
        return len(self.request_ids)

    def blocks(self, i: int) -> np.ndarray:
        return self.block_ids[self.block_offsets[i] : self.block_offsets[i + 1]]

    @classmethod
    def none(cls) -> NewRequests:
        return cls(
            request_ids=_EMPTY_I64,
            prompt_lens=_EMPTY_I64,
            poolings=np.empty(0, dtype=np.int8),
            normalize=np.empty(0, dtype=bool),
            dimensions=_EMPTY_I64,
            block_offsets=np.zeros(1, dtype=np.int64),
            block_ids=np.empty(0, dtype=np.int32),
        )


_NO_NEW = NewRequests.none()


@dataclass(frozen=True)
class StepPlan:
    """Everything a stage needs for one step. Small and picklable.

    Invariants: ``starts[i] < ends[i]``; ``num_tokens == sum(ends - starts)``; request ids are
    unique; ``starts[i]`` is the scheduler's expected ``num_computed_tokens`` of request i at
    step start, which each stage checks against its own mirror before computing. Requests
    scheduled for the first time are the plan's last ``len(new)`` rows, each from token 0.
    """

    step_id: int
    req_ids: np.ndarray  # [R] int64, batch order (the packed batch follows this order)
    starts: np.ndarray  # [R] int64 chunk start
    ends: np.ndarray  # [R] int64 chunk end, exclusive
    new: NewRequests = _NO_NEW
    # This step's prompt tokens, in batch order ([num_tokens] int64; a vision tower's steps:
    # [num_tokens, W] int64, one row of packed pixel values per position, models/
    # tower_vision.py). Only the first stage
    # embeds tokens, so the executor strips them before sending a plan to other stages.
    token_ids: np.ndarray = field(default_factory=_empty_i64)
    # Requests aborted before their final chunk: stages drop their mirrors after this step.
    freed_ids: tuple[int, ...] = ()
    num_tokens: int = 0  # == sum(ends - starts)
    # Token type ids of this step's tokens ([num_tokens] int64), for encoders fed pair inputs
    # (cross-encoders); empty when every token is type 0. Per token like token_ids, and like
    # them needed by the first stage only.
    token_type_ids: np.ndarray = field(default_factory=_empty_i64)
    # What the stages' state must hash to after this step (``digest.py``): row 0 for every
    # stage but the last, row 1 for the last ([2, NUM_PARTS] int64); empty when the engine
    # does not verify state.
    expected_state: np.ndarray = field(default_factory=_no_expectation)
    # Vision-language models: each token's M-RoPE position and image feature row
    # ([num_tokens, MEDIA_COLUMNS] int64, ``core/media.py``), for every stage; empty otherwise.
    media: np.ndarray = field(default_factory=no_media)

    def __post_init__(self) -> None:
        assert len(self.req_ids) == len(self.starts) == len(self.ends)
        assert self.num_tokens == int((self.ends - self.starts).sum())
        assert bool((self.starts < self.ends).all()), "empty chunk in plan"
        n_new = len(self.new)
        assert n_new <= len(self.req_ids)
        tail = slice(len(self.req_ids) - n_new, None)
        assert np.array_equal(self.req_ids[tail], self.new.request_ids), "new rows not last"
        assert not self.starts[tail].any(), "a new request starts after token 0"
        if len(self.new.key_lens):  # key lengths are bidirectional: such prompts run whole
            keyed = self.new.key_lens > 0
            assert np.array_equal(self.ends[tail][keyed], self.new.prompt_lens[keyed]), (
                "a request with a key length is split across steps"
            )
        assert len(self.token_ids) in (0, self.num_tokens)
        assert len(self.token_type_ids) in (0, self.num_tokens)
        assert self.media.shape in ((0, MEDIA_COLUMNS), (self.num_tokens, MEDIA_COLUMNS))
        assert _all_distinct(self.req_ids), "request scheduled twice"

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def is_flush(self) -> bool:
        return self.step_id == _FLUSH

    @property
    def is_trace(self) -> bool:
        return self.step_id == _TRACE

    def without_tokens(self) -> StepPlan:
        """The plan as stages after the first get it (positions and media rows stay: every
        stage applies them; images go to the first stage only)."""
        if not len(self.token_ids) and not len(self.token_type_ids) and not self.new.images:
            return self
        new = replace(self.new, images=()) if self.new.images else self.new
        return StepPlan(
            self.step_id, self.req_ids, self.starts, self.ends, new, _EMPTY_I64,
            self.freed_ids, self.num_tokens, _EMPTY_I64, self.expected_state, self.media,
        )  # fmt: skip


def _all_distinct(ids: np.ndarray) -> bool:
    # Plans list older requests first, so ids usually ascend: one pass, no sort.
    if len(ids) < 2 or bool((ids[1:] > ids[:-1]).all()):
        return True
    return len(np.unique(ids)) == len(ids)


# Control plans: step ids below 0 carry no work. (Stages stop through the store's "stop"
# key, not by a plan: a stage blocked on a send would never read one.)
_FLUSH, _TRACE = -2, -3


def flush_plan() -> StepPlan:
    """The plan that tells a last stage holding a step's results back to send them now
    (the driver is about to wait for them and has no further plan to send)."""
    return _control_plan(_FLUSH)


def trace_plan() -> StepPlan:
    """The plan that asks a stage process for its trace spans (and a few clock pings first)."""
    return _control_plan(_TRACE)


def _control_plan(step_id: int) -> StepPlan:
    return StepPlan(step_id=step_id, req_ids=_EMPTY_I64, starts=_EMPTY_I64, ends=_EMPTY_I64)


@dataclass(frozen=True)
class StepResult:
    """The last stage's answer to one plan: finished requests' outputs, as arrays.

    ``vectors`` row j belongs to request ``vector_ids[j]``: the pooled vector after the Dense
    head, Matryoshka truncation (components past the request's ``dimensions`` are 0) and
    normalisation. Token embeddings (ALL) of request ``token_owner_ids[j]`` are
    ``token_vectors[token_offsets[j]:token_offsets[j+1]]``.
    """

    step_id: int
    # Every stage's state digest, chained (``digest.py``); the driver checks it against the
    # plan's expected_state. None when the engine does not verify state.
    digest: Digest | None
    vector_ids: np.ndarray = field(default_factory=_empty_i64)  # [n] int64
    vectors: np.ndarray | None = None  # [n, D] float32
    token_owner_ids: np.ndarray = field(default_factory=_empty_i64)  # [m] int64
    token_offsets: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64))
    token_vectors: np.ndarray | None = None  # [sum of lengths, H] float32
    # Seconds each stage spent computing so far (stage order), for idle-fraction metrics.
    stage_busy_s: tuple[float, ...] = ()

    @property
    def finished_ids(self) -> np.ndarray:
        return np.concatenate([self.vector_ids, self.token_owner_ids])
