"""What a parity sweep crosses and how a row is judged: the settings (``Sweep``), the
thresholds, and the pieces every kind of sweep shares (prompts, previews, failed rows)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..config import POOLING_TYPES
from ..errors import InvalidInputError, PromptTooLongError
from ..intake.inputs import InputPreparer
from ..loading.deployment import Deployment
from .compare import Row, allowed_error
from .prompts import builtin_prompts
from .reference import ReferenceOutputs

# What a sweep compares unless told: the four every model has (the other sentence-transformers
# modes are there for the asking).
DEFAULT_POOLINGS = ("last", "mean", "cls", "all")
# docs/design.md §3: per-request cosine against the reference.
MIN_COSINE_FP32 = 0.99999
MIN_COSINE_16BIT = 0.999
# dtype int8 (dynamic int8 linear layers on the CPU) has no transformers int8 peer to scale a
# bar from: it is judged by this fixed floor against the float32 reference. all-MiniLM-L6-v2
# measured min 0.9918, mean 0.9972 on 59 real texts, min 0.9914 on the built-in prompts (every
# pooling, README "CPU: int8"): a floor for models it was not measured on, with room below.
MIN_COSINE_INT8 = 0.98
DEFAULT_PPS = (1, 2)
# Budgets that chunk at every prompt length, and one that (almost) never does.
DEFAULT_BUDGETS = (16, 64, 8192)
_PREVIEW_CHARS = 48


@dataclass(frozen=True)
class Sweep:
    """The settings a parity run crosses: every PP degree with every budget, every pooling."""

    pps: tuple[int, ...] = DEFAULT_PPS
    budgets: tuple[int, ...] = DEFAULT_BUDGETS
    # None: DEFAULT_POOLINGS for embedders; classifiers and dual encoders pool as their
    # checkpoints do, and refuse a choice
    poolings: tuple[str, ...] | None = None
    reference: str = "transformers"  # transformers | pp1
    min_cosine: float | None = None  # None: by dtype (see default_min_cosine)
    # Where the transformers reference runs; None: the engine's own device / dtype.
    reference_device: str | None = None
    reference_dtype: str | None = None
    # Classifiers: largest |engine - reference| per raw logit (None: by dtype, score_sweep.py);
    # page retrievers: per query-page MaxSim (vlm_sweep.py).
    max_score_diff: float | None = None

    @property
    def embedder_poolings(self) -> tuple[str, ...]:
        return self.poolings or DEFAULT_POOLINGS

    def refuse_poolings(self, what: str) -> None:
        """For models whose checkpoint decides the pooling (``what`` says which kind)."""
        if self.poolings is not None:
            raise InvalidInputError(
                f"{what} pools as its checkpoint says; poolings cannot be chosen for it",
                param="pooling",
            )

    def refuse_max_score_diff(self, what: str) -> None:
        """For models compared by vectors alone (``what`` says which kind)."""
        if self.max_score_diff is not None:
            raise InvalidInputError(
                f"{what} is compared by its vectors' cosine; max_score_diff applies to "
                "classifiers' scores and page retrievers' MaxSim",
                param="max_score_diff",
            )

    def uses_16bit_rule(self, deployment: Deployment) -> bool:
        """docs/design.md §3: a 16-bit engine against a float32 transformers reference is judged by
        transformers' own 16-bit error (where no fixed threshold was asked for)."""
        return (
            self.reference == "transformers"
            and self.reference_dtype == "float32"
            and deployment.dtype != torch.float32
        )

    def __post_init__(self) -> None:
        if not self.pps or not self.budgets or self.poolings == ():
            raise InvalidInputError("parity needs at least one PP degree, budget and pooling")
        unknown = [p for p in self.poolings or () if p not in POOLING_TYPES]
        if unknown:
            raise InvalidInputError(
                f"unknown pooling {unknown[0]!r}; choose from {', '.join(POOLING_TYPES)}",
                param="pooling",
            )


def default_min_cosine(dtype: torch.dtype) -> float:
    return MIN_COSINE_FP32 if dtype == torch.float32 else MIN_COSINE_16BIT


def cosine_bar(sweep: Sweep, deployment: Deployment) -> tuple[float, str | None]:
    """The per-request cosine threshold of a sweep's vector rows and, where it is not the plain
    threshold, its rule in words: ``--min-cosine`` if given, int8's fixed floor, else by dtype
    (a 16-bit engine against a float32 reference is then judged by ``sixteen_bit_bar``)."""
    if sweep.min_cosine is not None:
        return sweep.min_cosine, None
    if deployment.int8_linears:
        return MIN_COSINE_INT8, (
            f"cosine >= {MIN_COSINE_INT8} for every request: int8 is judged by this fixed "
            "floor (there is no transformers int8 reference), not by docs/design.md §3's "
            "16-bit rule"
        )
    return default_min_cosine(deployment.dtype), None


def sixteen_bit_bar(
    peer: ReferenceOutputs, ref: ReferenceOutputs, keys: Sequence[str], engine_dtype: str
) -> tuple[dict[str, list[np.ndarray]], str]:
    """docs/design.md §3's bar per output key and request, from transformers' own 16-bit
    outputs (``peer``) against the float32 reference, and the rule in words."""
    allowed = {
        k: [allowed_error(a, b) for a, b in zip(peer.outputs[k], ref.outputs[k], strict=True)]
        for k in keys
    }
    rule = (
        f"1 - cos(engine, reference) <= 1.5 x (1 - cos(transformers {engine_dtype}, "
        "reference)) + 1e-5 for every request"
    )
    return allowed, rule


def precision_of(deployment: Deployment) -> str:
    dtype = str(deployment.dtype).removeprefix("torch.")
    return f"int8 linear layers (dynamic), {dtype} otherwise" if deployment.int8_linears else dtype


def failed_row(row: Row, exc: BaseException, seconds: float) -> Row:
    row.error = f"{type(exc).__name__}: {exc}"
    row.seconds = seconds
    return row


def prompt_ids(deployment: Deployment, prompts: Sequence | None) -> tuple[list, list[np.ndarray]]:
    """The prompts and the engine's token ids for them (its tokenizer, the model's default
    prompt prefix, special tokens): what every configuration and the reference receive."""
    preparer = InputPreparer(deployment)
    if prompts is None:

        def count(text: str) -> int:
            try:
                return len(preparer.prepare([text])[0])
            except PromptTooLongError:
                return sys.maxsize

        prompts = builtin_prompts(count, deployment.max_model_len)
    prompts = list(prompts)
    return prompts, preparer.prepare(prompts)


def preview(prompt) -> str:
    text = prompt if isinstance(prompt, str) else f"<{len(prompt)} token ids>"
    return text if len(text) <= _PREVIEW_CHARS else text[: _PREVIEW_CHARS - 3] + "..."
