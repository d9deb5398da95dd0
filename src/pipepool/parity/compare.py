"""Scoring one configuration's outputs against the reference, request by request."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RequestScore:
    """How one request's engine output compares with the reference: cosine (the lowest
    token's for ALL pooling; nan when an output is not finite) and the largest absolute
    difference."""

    cosine: float  # for ALL pooling: the lowest over the request's tokens; nan if non-finite
    max_abs_diff: float
    worst_token: int | None = None  # ALL pooling: position of the lowest-cosine token


@dataclass
class Row:
    """One configuration (PP degree, token budget, pooling) of a parity run.

    ``error`` is set when the engine raised; the score fields are then None.
    """

    pp: int
    max_num_batched_tokens: int  # the token budget of one step
    pooling: str
    requests: int
    chunked: int  # requests that took more than one step (causal models; encoders never chunk)
    seconds: float = 0.0  # wall time of this pooling's encode call
    min_cosine: float | None = None
    mean_cosine: float | None = None  # mean over requests of each request's cosine
    worst_request: int | None = None  # index into the prompt list
    worst_prompt_tokens: int | None = None
    worst_token: int | None = None
    max_abs_diff: float | None = None
    error: str | None = None
    passed: bool = False

    @property
    def config(self) -> str:
        return f"pp={self.pp} tokens={self.max_num_batched_tokens} {self.pooling}"


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity in float64 (one value for 1-D inputs). Two zero vectors are
    identical (1.0); a zero vector against a non-zero one is 0.0."""
    a = np.atleast_2d(a).astype(np.float64)
    b = np.atleast_2d(b).astype(np.float64)
    num = (a * b).sum(-1)
    den = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    both_zero = (np.abs(a).max(-1) == 0) & (np.abs(b).max(-1) == 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        cos = num / den
    cos = np.where(den == 0, np.where(both_zero, 1.0, 0.0), cos)
    return np.where(np.isfinite(a).all(-1) & np.isfinite(b).all(-1), cos, np.nan)


def score_request(index: int, got: np.ndarray, expected: np.ndarray) -> RequestScore:
    """Cosine and largest absolute difference of one request; raises ValueError when the shapes
    differ (e.g. the reference tokenized the prompt differently)."""
    if got.shape != expected.shape:
        raise ValueError(
            f"request {index}: engine output has shape {tuple(got.shape)}, reference "
            f"{tuple(expected.shape)} (different tokenization or output size)"
        )
    cos = cosine_rows(got, expected)
    ranked = np.where(np.isnan(cos), -np.inf, cos)  # a non-finite output counts as the worst
    worst = int(np.argmin(ranked))
    diff = np.abs(got.astype(np.float64) - expected.astype(np.float64))
    max_diff = float(diff.max()) if diff.size else 0.0
    return RequestScore(
        cosine=float(cos[worst]),
        max_abs_diff=max_diff if math.isfinite(max_diff) else math.nan,
        worst_token=worst if got.ndim == 2 else None,
    )


def fill_row(row: Row, scores: list[RequestScore], lengths: list[int], min_cosine: float) -> Row:
    """Aggregate per-request scores into ``row`` and decide whether it passes."""
    values = np.array([s.cosine for s in scores], dtype=np.float64)
    ranked = np.where(np.isnan(values), -np.inf, values)
    worst = int(np.argmin(ranked))
    diffs = [s.max_abs_diff for s in scores]
    row.min_cosine = float(values[worst])
    row.mean_cosine = float(values.mean())
    row.worst_request = worst
    row.worst_prompt_tokens = lengths[worst]
    row.worst_token = scores[worst].worst_token
    row.max_abs_diff = math.nan if any(math.isnan(d) for d in diffs) else max(diffs)
    row.passed = row.min_cosine >= min_cosine  # False for nan
    return row


# docs/design.md §3's bar for a 16-bit engine against a float32 reference: its error may be up to
# this multiple of transformers' own 16-bit error on the same weights and prompts, plus this.
FLOOR_FACTOR, FLOOR_SLACK = 1.5, 1e-5


def allowed_error(peer: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Per request (per token for ALL pooling): the largest ``1 - cosine`` against the float32
    reference that docs/design.md §3 admits, from the 16-bit peer's own (nan where it is not
    finite, which no error satisfies)."""
    return FLOOR_FACTOR * (1 - cosine_rows(peer, reference)) + FLOOR_SLACK


def within_allowed(got: np.ndarray, reference: np.ndarray, allowed: np.ndarray) -> bool:
    """Whether every row of ``got`` is as close to the reference as ``allowed`` admits."""
    return bool(((1 - cosine_rows(got, reference)) <= allowed).all())  # nan: False
