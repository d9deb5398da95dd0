"""Running a parity sweep: every (PP degree, token budget) engine, every pooling on it, each
request scored against one reference computed up front."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..api.engine import Engine
from ..config import EngineConfig
from ..core.dual_encoders import DUAL_ENCODERS
from ..loading.deployment import plan_deployment
from .compare import Row, fill_row, score_request, within_allowed
from .reference import compute_reference
from .report import ParityReport
from .settings import (
    Sweep,
    cosine_bar,
    failed_row,
    precision_of,
    preview,
    prompt_ids,
    sixteen_bit_bar,
)

if TYPE_CHECKING:
    from .score_sweep import ScoreReport


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
        sweep.refuse_max_score_diff("a dual encoder")
        return run_tower_parity(base, deployment, sweep, prompts, log)
    from .vlm_sweep import is_vlm

    if is_vlm(deployment):  # texts, images and texts with images
        from .vlm_sweep import run_vlm_parity

        return run_vlm_parity(base, deployment, sweep, prompts, log)
    sweep.refuse_max_score_diff("an embedding model")
    poolings = sweep.embedder_poolings
    texts, token_ids = prompt_ids(deployment, prompts)
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
    threshold, rule = cosine_bar(sweep, deployment)
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
        engine=f"pipepool, {precision_of(deployment)} on {deployment.devices[0].split(':')[0]}",
        min_cosine=threshold,
        prompt_tokens=lengths,
        prompt_previews=[preview(t) for t in texts],
        rule=rule,
    )
    for pp in sweep.pps:
        for budget in sweep.budgets:
            log(f"pp={pp} tokens={budget}: {', '.join(poolings)}")
            config = base.replace(pipeline_parallel_size=pp, max_num_batched_tokens=budget)
            report.rows += _run_config(config, poolings, token_ids, ref.outputs, threshold, allowed)
    return report


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
        return [failed_row(row(p), exc, 0.0) for p in poolings]
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
                rows.append(failed_row(row(pooling, chunked), exc, time.perf_counter() - t0))
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


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
