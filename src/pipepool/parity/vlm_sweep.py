"""``pipepool parity`` on a vision-language model: texts, images and texts with images at every
PP degree and token budget, each output against transformers on the same weights (or the
engine at PP 1 with one step per prompt), per input.

A vision-language embedder (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) is compared in four groups, each
with every pooling: ``text`` (the prompts as token ids, the decoder alone), ``text-dict``
(texts as dict inputs, through the chat template), ``image`` (each built-in image alone) and
``text+image`` (texts with one or two images); against ``Qwen2VLModel`` (...) at every token.
A page retriever (ColQwen2, ColPali) pools every token: ``query`` (texts) and ``page`` (each
built-in image) token vectors against ``ColQwen2ForRetrieval`` / ``ColPaliForRetrieval``, and
``maxsim``, every query against every page, against the processor's ``score_retrieval``.

Small budgets cut through an image's placeholder tokens (causal decoders chunk them; ColPali's
bidirectional prompts run whole, each alone in its step)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..api.engine import Engine
from ..api.retrieval import max_sim
from ..api.vlm import PAGE_RETRIEVERS, prompt_formatter
from ..config import EngineConfig
from ..intake.images import ImageLimits
from ..intake.vlm_inputs import parse_input
from ..loading.deployment import Deployment
from ..models import family_of
from .compare import Row, fill_row, score_request, within_allowed
from .prompts import REPRODUCER_PROMPTS, builtin_images
from .reference import ReferenceOutputs
from .report import ParityReport
from .score_sweep import MAX_SCORE_DIFF_16BIT, MAX_SCORE_DIFF_FP32, allowed_score_error
from .settings import (
    Sweep,
    cosine_bar,
    failed_row,
    precision_of,
    preview,
    prompt_ids,
    sixteen_bit_bar,
)
from .vlm_reference import EnginePrompt, vlm_reference

MAXSIM = "maxsim"


def is_vlm(deployment: Deployment) -> bool:
    """Whether ``deployment`` takes texts with images (``api/vlm.py``'s families)."""
    from ..api.vlm import VLM_FAMILIES

    return family_of(deployment.folder.architecture).name in VLM_FAMILIES


def run_vlm_parity(
    base: EngineConfig,
    deployment: Deployment,
    sweep: Sweep,
    prompts: Sequence | None,
    log: Callable[[str], None],
) -> ParityReport:
    retriever = PAGE_RETRIEVERS.get(family_of(deployment.folder.architecture).name)
    if retriever is not None:
        sweep.refuse_poolings(f"{retriever} (a vector per token)")
    else:
        sweep.refuse_max_score_diff("a vision-language embedder")
    poolings = ("all",) if retriever else sweep.embedder_poolings
    groups, seen = _groups(deployment, prompts, bool(retriever), log)
    lengths = {g: [_length(i, s) for i, s in zip(groups[g], seen[g], strict=True)] for g in groups}
    log(f"reference: {sweep.reference} on {', '.join(f'{len(v)} {g}' for g, v in groups.items())}")
    ref = _reference(sweep.reference, deployment, groups, seen, poolings, bool(retriever),
                     sweep.reference_device, sweep.reference_dtype, lengths)  # fmt: skip
    keys = [k for k in ref.outputs if k != MAXSIM]
    threshold, rule = cosine_bar(sweep, deployment)
    fp32 = deployment.dtype == torch.float32 and not deployment.int8_linears
    max_sim_diff = sweep.max_score_diff
    if retriever and max_sim_diff is None:
        max_sim_diff = MAX_SCORE_DIFF_FP32 if fp32 else MAX_SCORE_DIFF_16BIT
    allowed = None
    if sweep.min_cosine is None and sweep.uses_16bit_rule(deployment):
        engine_dtype = str(deployment.dtype).removeprefix("torch.")
        log(f"reference: transformers in {engine_dtype} too, for docs/design.md §3's bar")
        peer = _reference("transformers", deployment, groups, seen, poolings, bool(retriever),
                          sweep.reference_device, engine_dtype, lengths)  # fmt: skip
        allowed, rule = sixteen_bit_bar(peer, ref, keys, engine_dtype)
        if MAXSIM in ref.outputs and sweep.max_score_diff is None:
            error = float(np.abs(np.stack(peer.outputs[MAXSIM]) - np.stack(ref.outputs[MAXSIM]))
                          .max())  # fmt: skip
            max_sim_diff = allowed_score_error(error)
    starts: dict[str, int] = {}
    previews: list[str] = []
    tokens: list[int] = []
    for group, items in groups.items():
        starts[group] = len(previews)
        previews += [_preview(i) for i in items]
        tokens += lengths[group]
    report = ParityReport(
        model=str(deployment.folder.path),
        reference=ref.description,
        engine=f"pipepool, {precision_of(deployment)} on {deployment.devices[0].split(':')[0]}",
        min_cosine=threshold,
        prompt_tokens=tokens,
        prompt_previews=previews,
        rule=rule,
        max_sim_diff=max_sim_diff,
    )
    for pp in sweep.pps:
        for budget in sweep.budgets:
            log(f"pp={pp} tokens={budget}: {', '.join(groups)}")
            config = base.replace(pipeline_parallel_size=pp, max_num_batched_tokens=budget)
            run = _Config(config, groups, lengths, poolings, bool(retriever))
            for r in run.rows(ref.outputs, threshold, allowed, max_sim_diff):
                group = r.pooling.split(" ")[0]
                if r.worst_request is not None and group in starts:  # numbered as reported
                    r.worst_request += starts[group]
                report.rows.append(r)
    return report


def _groups(
    deployment: Deployment, prompts: Sequence | None, retriever: bool, log
) -> tuple[dict[str, list], dict[str, list[EnginePrompt | None]]]:
    """The inputs of each group, and what the engine enqueues for each dict input (None: token
    ids). Dict inputs over max_model_len (their images' placeholders counted) are left out,
    with a line in the log."""
    given = [p for p in prompts or () if isinstance(p, str)]
    texts = given or list(REPRODUCER_PROMPTS)
    images = builtin_images()
    groups: dict[str, list] = {}
    if retriever:
        groups["query"] = [{"text": t} for t in texts]
        groups["page"] = [{"image": i} for i in images]
    else:
        groups["text"] = prompt_ids(deployment, prompts)[1]
        groups["text-dict"] = [{"text": t} for t in texts]
        groups["image"] = [{"image": i} for i in images]
        groups["text+image"] = [
            {"text": texts[min(1, len(texts) - 1)], "image": images[0]},
            {"text": texts[len(texts) // 2], "images": [images[1], images[4]]},
            {"text": texts[0], "images": [images[3], images[2]]},
        ]
    formatter = prompt_formatter(deployment, ImageLimits(None, deployment.config.max_image_pixels))
    seen: dict[str, list[EnginePrompt | None]] = {}
    for group, items in groups.items():
        if group == "text":
            seen[group] = [None] * len(items)
            continue
        kept: list = []
        prepared: list[EnginePrompt | None] = []
        for i, item in enumerate(items):
            text, raw = parse_input(item, i)
            prompt = formatter.prompt(text, formatter.decode(raw, i), i)
            if len(prompt.token_ids) > deployment.max_model_len:
                log(f"{group} input {i} left out: {len(prompt.token_ids)} tokens with its images'"
                    f" placeholders, over max_model_len {deployment.max_model_len}")  # fmt: skip
                continue
            kept.append(item)
            prepared.append(EnginePrompt(prompt.token_ids, [m.pixels for m in prompt.images],
                                         [m.grid for m in prompt.images]))  # fmt: skip
        groups[group], seen[group] = kept, prepared
    return {g: v for g, v in groups.items() if v}, {g: seen[g] for g in groups if groups[g]}


def _length(item, seen: EnginePrompt | None) -> int:
    return len(item) if seen is None else len(seen.token_ids)


def _preview(item) -> str:
    if not isinstance(item, dict):
        return preview(item)
    images = item.get("images", [item["image"]] if "image" in item else [])
    shown = " ".join(f"<image {i.width}x{i.height} {i.mode}>" for i in images)
    return preview(" ".join(p for p in (shown, item.get("text", "")) if p))


class _Config:
    """One (PP degree, budget) engine over every group: its rows."""

    def __init__(self, config: EngineConfig, groups, lengths, poolings, retriever: bool) -> None:
        self.config, self.groups, self.lengths = config, groups, lengths
        self.poolings, self.retriever = poolings, retriever

    def row_keys(self) -> list[str]:
        if self.retriever:  # MaxSim where there are queries and pages to pair
            pairs = {"query", "page"} <= set(self.groups)
            return [*self.groups, MAXSIM] if pairs else [*self.groups]
        return [f"{g} {p}" for g in self.groups for p in self.poolings]

    def row(self, key: str, chunked: int = 0) -> Row:
        budget = self.config.max_num_batched_tokens
        assert budget is not None, "each configuration of a sweep names its token budget"
        group = key.split(" ")[0]
        requests = (len(self.groups["query"]) * len(self.groups["page"]) if key == MAXSIM
                    else len(self.groups[group]))  # fmt: skip
        return Row(pp=self.config.pipeline_parallel_size, max_num_batched_tokens=budget,
                   pooling=key, requests=requests, chunked=chunked)  # fmt: skip

    def rows(self, expected, threshold: float, allowed, max_sim_diff: float | None) -> list[Row]:
        try:
            engine = Engine.from_config(self.config)
        except Exception as exc:  # e.g. more stages than layers
            return [failed_row(self.row(k), exc, 0.0) for k in self.row_keys()]
        rows: list[Row] = []
        got_all: dict[str, list[np.ndarray]] = {}
        with engine:
            for key in self.row_keys():
                if key == MAXSIM:
                    rows.append(self._max_sim(got_all, expected[MAXSIM], max_sim_diff))
                    continue
                group, pooling = (key, "all") if self.retriever else key.split(" ")
                t0 = time.perf_counter()
                chunked_before = engine.stats.chunked_requests
                try:
                    got = _pool(engine, self.groups[group], pooling, self.retriever)
                    scores = [
                        score_request(i, g, e)
                        for i, (g, e) in enumerate(zip(got, expected[key], strict=True))
                    ]
                except Exception as exc:
                    chunked = engine.stats.chunked_requests - chunked_before
                    rows.append(failed_row(self.row(key, chunked), exc, time.perf_counter() - t0))
                    continue
                got_all[key] = got
                r = self.row(key, engine.stats.chunked_requests - chunked_before)
                r.seconds = time.perf_counter() - t0
                r = fill_row(r, scores, self.lengths[group], threshold)
                if allowed is not None:
                    r.passed = all(within_allowed(g, e, a) for g, e, a in
                                   zip(got, expected[key], allowed[key], strict=True))  # fmt: skip
                rows.append(r)
        return rows

    def _max_sim(self, got: dict, expected: list[np.ndarray], bar: float | None) -> Row:
        row = self.row(MAXSIM)
        if "query" not in got or "page" not in got:
            return failed_row(row, RuntimeError("no MaxSim: a query or page row failed"), 0.0)
        scores = _max_sims(got["query"], got["page"])
        diff = np.abs(scores.astype(np.float64) - np.concatenate(expected))
        ranked = np.where(np.isnan(diff), np.inf, diff)
        row.worst_request = int(np.argmax(ranked))
        row.max_abs_diff = float(ranked.max())
        row.passed = bar is not None and row.max_abs_diff <= bar  # inf (nan) fails
        return row


def _pool(engine: Engine, items: list, pooling: str, retriever: bool) -> list[np.ndarray]:
    """Raw vectors (the token ids of ``text`` or dict inputs); a page retriever's normalised,
    as ``ColQwen2ForRetrieval`` and ``ColPaliForRetrieval`` give them."""
    return engine.pool(items, pooling=pooling, normalize=retriever)


def _max_sims(queries: list[np.ndarray], pages: list[np.ndarray]) -> np.ndarray:
    """Every query against every page, query-major (as the report numbers the pairs)."""
    return np.array([max_sim(q, p) for q in queries for p in pages], dtype=np.float32)


def _reference(
    kind: str, deployment: Deployment, groups: dict[str, list], seen, poolings, retriever: bool,
    device, dtype, lengths,
) -> ReferenceOutputs:  # fmt: skip
    if kind == "pp1":
        budget = max(max(v) for v in lengths.values())  # every input in one step: no chunking
        config = deployment.config.replace(pipeline_parallel_size=1, pp_partition=None,
                                           max_num_batched_tokens=budget)  # fmt: skip
        run = _Config(config, groups, lengths, poolings, retriever)
        outputs: dict[str, list[np.ndarray]] = {}
        with Engine.from_config(config) as engine:
            for key in run.row_keys():
                if key == MAXSIM:
                    sims = _max_sims(outputs["query"], outputs["page"])
                    outputs[key] = [np.array([s]) for s in sims]
                    continue
                group, pooling = (key, "all") if retriever else key.split(" ")
                outputs[key] = _pool(engine, groups[group], pooling, retriever)
        return ReferenceOutputs(f"pipepool PP=1, whole prompts (budget {budget})", outputs)
    if kind != "transformers":
        from .reference import REFERENCES, ParityError

        raise ParityError(f"unknown reference {kind!r}; choose one of {', '.join(REFERENCES)}")
    where = device or deployment.devices[0]
    torch_dtype = getattr(torch, dtype) if dtype else deployment.dtype
    return vlm_reference(deployment, groups, seen, tuple(poolings), where, torch_dtype)
