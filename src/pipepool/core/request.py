"""What the driver holds for the prompts it was given: pooling parameters and batches of
requests submitted together."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property

import numpy as np

from .media import MEDIA_COLUMNS, ImageInput


class Pooling(IntEnum):
    """Pooling kinds as the small integers plans carry (one per request, vectorised)."""

    LAST = 0
    MEAN = 1
    CLS = 2
    ALL = 3  # token embeddings: one vector per prompt token
    # sentence-transformers' other Pooling modes: the elementwise max over the tokens; the sum
    # over sqrt(length); the mean weighted by position (1, 2, ..., length); SpladePooling's sum.
    MAX = 4
    MEAN_SQRT_LEN = 5
    WEIGHTEDMEAN = 6
    SUM = 7  # the plain sum over the tokens (SPLADE's sum pooling)

    @classmethod
    def parse(cls, name: str) -> Pooling:
        return cls[name.upper()]

    @property
    def is_vector(self) -> bool:
        """One vector per request, as opposed to one per token (ALL)."""
        return self != Pooling.ALL


POOLING_NAMES = tuple(p.name.lower() for p in Pooling)


@dataclass(frozen=True)
class PoolingParams:
    """What the last stage computes for a request (pooling, then Matryoshka truncation, then
    L2 normalisation; per token for ALL)."""

    pooling: str  # one of POOLING_NAMES
    normalize: bool = False
    dimensions: int | None = None  # keep the first `dimensions` components

    @cached_property  # read for every request on the engine's paths: parsed once
    def code(self) -> Pooling:
        return Pooling.parse(self.pooling)


class RequestBatch:
    """Prompts submitted together: they share pooling parameters and take consecutive request
    ids ``first_id .. first_id + n - 1``, so a request id maps to its row by subtraction.

    The scheduler admits a batch's requests in order; ``cursor`` is the first row not yet
    admitted. Tokens live back to back in one array (``offsets[i]:offsets[i+1]`` is prompt i),
    so a step's tokens are mostly one slice of it.

    ``key_lens`` (bidirectional models only): per prompt, how many of its first tokens are
    keys of its attention; the tokens after them still attend and produce outputs, but no
    token attends to them (ColBERT's query expansion: [MASK] padding with attention mask 0).
    0 or the prompt's length: every token is a key. None: so for every prompt.

    ``background``: batch-job work (``core.priority``), admitted only where online batches
    leave room in a step. ``call``: the call it belongs to (the first id of that call's first
    batch; a call's slices share it), which takes turns with other calls as one.

    ``media`` and ``images`` (vision-language prompts, ``core/media.py``): each token's M-RoPE
    position and image feature row, parallel to ``token_ids``; each prompt's images.
    """

    __slots__ = (
        "background", "call", "cancelled", "cursor", "first_id", "images", "key_lens",
        "lengths", "media", "num_tokens", "offsets", "params", "token_ids", "type_ids",
    )  # fmt: skip

    def __init__(
        self,
        first_id: int,
        token_ids: np.ndarray,
        lengths: np.ndarray,
        params: PoolingParams,
        type_ids: np.ndarray | None = None,
        key_lens: np.ndarray | None = None,
        background: bool = False,
        media: np.ndarray | None = None,
        images: list[tuple[ImageInput, ...]] | None = None,
    ) -> None:
        assert len(lengths) > 0 and bool((lengths > 0).all()), "empty batch or prompt"
        self.first_id = first_id
        self.params = params
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self.offsets[1:])
        assert len(token_ids) == self.offsets[-1], "lengths do not add up to the tokens"
        # Read on every step's scans of the queue (``Scheduler``): one int, not an array read.
        self.num_tokens = int(self.offsets[-1])
        self.token_ids = np.asarray(token_ids, dtype=np.int64)
        # Token type (segment) ids of pair inputs, parallel to token_ids; None: type 0 throughout.
        self.type_ids = None if type_ids is None else np.asarray(type_ids, dtype=np.int64)
        assert self.type_ids is None or len(self.type_ids) == len(self.token_ids)
        # Keys per prompt, parallel to lengths ([n] int64); 0: every token is a key.
        self.key_lens = None if key_lens is None else np.asarray(key_lens, dtype=np.int64)
        if self.key_lens is not None:
            assert len(self.key_lens) == len(self.lengths), "one key length per prompt"
            assert bool(((self.key_lens >= 0) & (self.key_lens <= self.lengths)).all()), (
                "key lengths must lie in [1, prompt length] (0: every token is a key)"
            )
        self.media = media
        assert media is None or media.shape == (len(self.token_ids), MEDIA_COLUMNS)
        self.images = images
        assert images is None or len(images) == len(self.lengths), "images per prompt"
        self.background = background
        self.call = first_id
        self.cursor = 0
        self.cancelled = False  # aborted: nothing more is admitted, results are dropped

    @classmethod
    def from_prompts(
        cls, first_id: int, prompts: list[np.ndarray], params: PoolingParams
    ) -> RequestBatch:
        lengths = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=len(prompts))
        return cls(first_id, np.concatenate(prompts), lengths, params)

    def __len__(self) -> int:
        return len(self.lengths)

    def rows(self, first_id: int, lo: int, hi: int) -> RequestBatch:
        """Rows ``lo .. hi - 1`` as a batch of their own, with ids from ``first_id`` (a
        restarted pipeline runs unfinished requests again under new ids)."""
        tokens, types, media = self.span(int(self.offsets[lo]), int(self.offsets[hi]))
        keys = self.key_lens[lo:hi] if self.key_lens is not None else None
        images = self.images[lo:hi] if self.images is not None else None
        batch = RequestBatch(
            first_id, tokens, self.lengths[lo:hi], self.params, types, keys, self.background,
            media, images,
        )  # fmt: skip
        batch.call = self.call
        return batch

    @property
    def has_key_lens(self) -> bool:
        """Whether some prompt keys only a prefix of its tokens."""
        keys = self.key_lens
        return keys is not None and bool(((keys > 0) & (keys < self.lengths)).any())

    @property
    def end_id(self) -> int:
        """One past the last request id of the batch."""
        return self.first_id + len(self.lengths)

    def prompt(self, row: int) -> np.ndarray:
        return self.token_ids[self.offsets[row] : self.offsets[row + 1]]

    def span(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Tokens ``lo:hi`` of the flat token array, their type ids (None: all type 0) and
        media rows (None: a text model's)."""
        types = self.type_ids[lo:hi] if self.type_ids is not None else None
        media = self.media[lo:hi] if self.media is not None else None
        return self.token_ids[lo:hi], types, media

    def tokens(self, rows: np.ndarray) -> np.ndarray:
        """Whole prompts of ``rows`` (ascending), back to back."""
        lo, hi = int(rows[0]), int(rows[-1])
        if hi - lo + 1 == len(rows):  # consecutive rows: one slice, no copy
            return self.token_ids[self.offsets[lo] : self.offsets[hi + 1]]
        return np.concatenate([self.prompt(int(r)) for r in rows])
