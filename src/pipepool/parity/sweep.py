"""Running a parity sweep: every (PP degree, token budget) engine, every pooling on it, each
request scored against one reference computed up front."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..api.engine import Engine
from ..config import POOLING_TYPES, EngineConfig
from ..core.dual_encoders import DUAL_ENCODERS
from ..errors import InvalidInputError, PromptTooLongError
from ..intake.inputs import InputPreparer
from ..loading.deployment import Deployment, plan_deployment
from .compare import Row, allowed_error, fill_row, score_request, within_allowed
from .prompts import builtin_prompts
from .reference import ReferenceOutputs, compute_reference
from .report import ParityReport

# What a sweep compares unless told: the four every model has (the other sentence-transformers
# modes are there for the asking).
DEFAULT_POOLINGS = ("last", "mean", "cls", "all")

if TYPE_CHECKING:
    from .score_sweep import ScoreReport

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
    # Classifiers: largest |engine - reference| per raw logit (None: by dtype, score_sweep.py).
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


def run_parity(
    base: EngineConfig,
    sweep: Sweep,
    prompts: Sequence | None = None,
    log: Callable[[str], None] | None = None,
) -> ParityReport | ScoreReport:
    """Compare every configuration of ``sweep`` with the reference on ``prompts`` (default:
    the built-in set). An engine that raises becomes a failed row; it does not stop the run."""
    log = log or _stderr
    deployment = plan_deployment(base)  # resolves dtype, device and max_model_len once
    if deployment.classifier is not None:  # scores, not vectors: compared per pair
        from .score_sweep import run_score_parity

        sweep.refuse_poolings("a classifier (its head)")
        return run_score_parity(base, deployment, sweep, prompts, log)
    if deployment.folder.architecture in DUAL_ENCODERS:  # texts and images, per tower
        from .tower_sweep import run_tower_parity

        sweep.refuse_poolings("a dual encoder (each tower)")
        return run_tower_parity(base, deployment, sweep, prompts, log)
    poolings = sweep.embedder_poolings
    texts, token_ids = _prompts(deployment, prompts)
    lengths = [len(ids) for ids in token_ids]
    log(f"reference: {sweep.reference} on {len(texts)} prompts ({max(lengths)} tokens max)")
    ref = compute_reference(
        sweep.reference,
        deployment,
        texts,
        token_ids,
        poolings,
        device=sweep.reference_device,
        dtype=sweep.reference_dtype,
    )
    threshold = sweep.min_cosine
    rule = None
    if threshold is None and deployment.int8_linears:
        threshold = MIN_COSINE_INT8
        rule = (
            f"cosine >= {MIN_COSINE_INT8} for every request: int8 is judged by this fixed "
            "floor (there is no transformers int8 reference), not by docs/design.md §3's "
            "16-bit rule"
        )
    if threshold is None:
        threshold = default_min_cosine(deployment.dtype)
    allowed = None  # per pooling and prompt: docs/design.md §3's bar, where it applies
    if sweep.min_cosine is None and sweep.uses_16bit_rule(deployment):
        engine_dtype = str(deployment.dtype).removeprefix("torch.")
        log(f"reference: transformers in {engine_dtype} too, for docs/design.md §3's bar")
        peer = compute_reference(
            "transformers", deployment, texts, token_ids, poolings,
            device=sweep.reference_device, dtype=engine_dtype,
        )  # fmt: skip
        allowed, rule = sixteen_bit_bar(peer, ref, poolings, engine_dtype)
    report = ParityReport(
        model=str(deployment.folder.path),
        reference=ref.description,
        engine=f"pipepool, {_precision(deployment)} on {deployment.devices[0].split(':')[0]}",
        min_cosine=threshold,
        prompt_tokens=lengths,
        prompt_previews=[_preview(t) for t in texts],
        rule=rule,
    )
    for pp in sweep.pps:
        for budget in sweep.budgets:
            log(f"pp={pp} tokens={budget}: {', '.join(poolings)}")
            config = base.replace(pipeline_parallel_size=pp, max_num_batched_tokens=budget)
            report.rows += _run_config(config, poolings, token_ids, ref.outputs, threshold, allowed)
    return report


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


def _precision(deployment: Deployment) -> str:
    dtype = str(deployment.dtype).removeprefix("torch.")
    return f"int8 linear layers (dynamic), {dtype} otherwise" if deployment.int8_linears else dtype


def _run_config(
    config: EngineConfig,
    poolings: Sequence[str],
    token_ids: list[np.ndarray],
    expected: dict[str, list[np.ndarray]],
    threshold: float,
    allowed: dict[str, list[np.ndarray]] | None = None,
) -> list[Row]:
    """All poolings on one engine. Any exception is the row's result: a dead engine fails
    its remaining poolings with the cause in their message. ``allowed``: docs/design.md §3's bar
    per request, which then decides whether a row passes (``threshold`` otherwise)."""
    budget = config.max_num_batched_tokens
    assert budget is not None, "each configuration of a sweep names its token budget"

    def row(pooling: str, chunked: int = 0) -> Row:
        return Row(
            pp=config.pipeline_parallel_size,
            max_num_batched_tokens=budget,
            pooling=pooling,
            requests=len(token_ids),
            chunked=chunked,
        )

    try:
        engine = Engine.from_config(config)
    except Exception as exc:  # e.g. more stages than layers or GPUs
        return [_failed(row(p), exc, 0.0) for p in poolings]
    rows = []
    with engine:
        # the path a warm engine serves with (eager: --no-compile)
        engine.pipeline.wait_until_compiled(None)
        for pooling in poolings:
            t0 = time.perf_counter()
            # Counted by the scheduler, not from prompt lengths: a prompt shorter than the
            # budget is split too when the requests ahead of it leave less room in the step.
            chunked_before = engine.stats.chunked_requests
            try:
                got = engine.pool(token_ids, pooling=pooling, normalize=False)
                scores = [
                    score_request(i, g, e)
                    for i, (g, e) in enumerate(zip(got, expected[pooling], strict=True))
                ]
            except Exception as exc:
                chunked = engine.stats.chunked_requests - chunked_before
                rows.append(_failed(row(pooling, chunked), exc, time.perf_counter() - t0))
                continue
            r = row(pooling, engine.stats.chunked_requests - chunked_before)
            r.seconds = time.perf_counter() - t0
            r = fill_row(r, scores, [len(t) for t in token_ids], threshold)
            if allowed is not None:
                r.passed = all(
                    within_allowed(g, e, a)
                    for g, e, a in zip(got, expected[pooling], allowed[pooling], strict=True)
                )
            rows.append(r)
    return rows


def _failed(row: Row, exc: BaseException, seconds: float) -> Row:
    row.error = f"{type(exc).__name__}: {exc}"
    row.seconds = seconds
    return row


def _prompts(deployment: Deployment, prompts: Sequence | None) -> tuple[list, list[np.ndarray]]:
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


def _preview(prompt) -> str:
    text = prompt if isinstance(prompt, str) else f"<{len(prompt)} token ids>"
    return text if len(text) <= _PREVIEW_CHARS else text[: _PREVIEW_CHARS - 3] + "..."


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
