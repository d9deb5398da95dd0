"""``pipepool parity`` for classifiers (cross-encoders, rerankers, sequence classifiers): every
(PP degree, token budget) engine scores the same query-document pairs (texts, for a classifier
of several labels), and each pair's raw logits are compared with the reference's
(``score_reference.py``). A configuration passes when every pair is within the tolerance and
the documents rank in the reference's order (pairs whose reference scores are closer than
twice the tolerance may swap)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from ..api.engine import Engine
from ..config import EngineConfig
from ..intake.inputs import InputPreparer
from ..intake.pairs import PairEncoder
from ..loading.deployment import Deployment
from .compare import FLOOR_FACTOR, FLOOR_SLACK
from .prompts import builtin_prompts
from .reference import ParityError
from .report import _finite, _num, markdown_table
from .score_reference import score_reference

PARITY_QUERY = "How does a pipeline-parallel engine keep its stages in step?"
# Largest |engine - reference| per raw logit that passes. 16-bit: a rule of thumb for bf16
# rounding on logits of order 1-10, used where docs/design.md §3's bar (a float32 transformers
# reference, allowed_score_error) does not apply; --max-score-diff sets one.
MAX_SCORE_DIFF_FP32 = 1e-4
MAX_SCORE_DIFF_16BIT = 5e-2
_COLUMNS = ("configuration", "pairs", "chunked", "max |diff|", "worst pair", "order", "seconds",
            "result")  # fmt: skip


@dataclass
class ScoreRow:
    """One configuration (PP degree, token budget) of a score parity run: the largest score
    difference, where it was, and whether the ranking matches the reference's."""

    pp: int
    max_num_batched_tokens: int
    pairs: int
    chunked: int = 0
    seconds: float = 0.0
    max_abs_diff: float | None = None
    worst_pair: int | None = None  # index into the documents
    worst_pair_tokens: int | None = None
    same_order: bool | None = None  # None: a classifier of several labels ranks nothing
    error: str | None = None
    passed: bool = False

    @property
    def config(self) -> str:
        return f"pp={self.pp} tokens={self.max_num_batched_tokens}"


@dataclass
class ScoreReport:
    """A score parity run for a classifier or reranker: the pairs, the reference and the
    per-logit threshold, and one ``ScoreRow`` per configuration; it passes when every row does."""

    model: str
    reference: str
    engine: str
    max_score_diff: float  # the pass threshold, per logit
    query: str | None  # None: documents classified alone
    prompt_tokens: list[int]  # each pair's (or text's) prompt length
    prompt_previews: list[str]
    rows: list[ScoreRow] = field(default_factory=list)
    rule: str | None = None  # how max_score_diff was set, where it is not a fixed default

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.passed for r in self.rows)

    def failures(self) -> list[ScoreRow]:
        return [r for r in self.rows if not r.passed]

    def to_dict(self) -> dict:
        keys = ("model", "reference", "engine", "max_score_diff", "rule")
        head = {k: getattr(self, k) for k in keys}
        prompts = [
            {"index": i, "tokens": n, "preview": p}
            for i, (n, p) in enumerate(zip(self.prompt_tokens, self.prompt_previews, strict=True))
        ]
        rows = [{"configuration": r.config, **asdict(r)} for r in self.rows]
        return _finite({**head, "query": self.query, "passed": self.passed, "prompts": prompts,
                        "rows": rows})  # fmt: skip

    def header(self) -> str:
        lengths = self.prompt_tokens
        what = f"query {self.query!r} with each document" if self.query else "each text alone"
        return (
            f"model:     {self.model}\n"
            f"engine:    {self.engine}\n"
            f"reference: {self.reference}\n"
            f"pairs:     {len(lengths)}, {what} ({min(lengths)}..{max(lengths)} tokens: "
            f"{', '.join(map(str, lengths))})\n"
            f"pass:      {self.rule or f'|raw logit - reference| <= {self.max_score_diff}'} for "
            "every pair, ranking as the reference's"
        )

    def table(self) -> str:
        return markdown_table([_COLUMNS, *(_cells(r) for r in self.rows)], {1, 2, 3, 6})

    def summary(self) -> str:
        lines = []
        for r in self.failures():
            if r.error is not None:
                lines.append(f"FAIL {r.config}: {r.error}")
            elif r.same_order is False:
                lines.append(f"FAIL {r.config}: documents rank in another order")
            else:
                lines.append(
                    f"FAIL {r.config}: worst pair #{r.worst_pair} ({r.worst_pair_tokens} tokens) "
                    f"is {_num(r.max_abs_diff, 2, exp=True)} off > {self.max_score_diff}"
                )
        n = len(self.rows)
        verdict = "parity OK" if self.passed else "parity FAILED"
        lines.append(f"{verdict}: {n - len(self.failures())} of {n} configurations pass")
        return "\n".join(lines)


def run_score_parity(
    base: EngineConfig,
    deployment: Deployment,
    sweep,
    documents: Sequence[str] | None,
    log: Callable[[str], None],
) -> ScoreReport:
    """``sweep``: a ``sweep.Sweep`` (its poolings do not apply: the head decides)."""
    head = deployment.classifier
    assert head is not None, "scores come from a classifier"
    preparer = InputPreparer(deployment)
    query = PARITY_QUERY if head.can_rerank else None
    if query is not None:
        pairs_of = PairEncoder(deployment, preparer)
        if documents is None:
            documents = builtin_prompts(
                lambda doc: pairs_of.length(query, doc), deployment.max_model_len
            )
        if not documents:
            raise ParityError(
                f"no built-in document fits with the query in max_model_len "
                f"{deployment.max_model_len}: the pair's prompt alone takes "
                f"{pairs_of.length(query, '')} tokens (raise --max-model-len or give --prompts)"
            )
        pairs = ([query] * len(documents), list(documents))
        tokens = pairs_of.encode(*pairs, limit=None)
    else:
        if documents is None:
            documents = builtin_prompts(
                lambda t: len(preparer.tokenizer.encode_batch([t])[0]), deployment.max_model_len
            )
        pairs = ([], list(documents))
        (tokens,) = preparer.token_slices(list(documents), long_inputs="error", slice_size=1 << 30)
    lengths = tokens.lengths.tolist()
    log(f"reference: {sweep.reference} on {len(lengths)} prompts ({max(lengths)} tokens max)")
    ref = score_reference(
        sweep.reference, deployment, pairs, tokens,
        device=sweep.reference_device, dtype=sweep.reference_dtype,
    )  # fmt: skip
    expected = np.stack(ref.outputs["score"])
    threshold, rule = sweep.max_score_diff, None
    if threshold is None and sweep.uses_16bit_rule(deployment):
        engine_dtype = str(deployment.dtype).removeprefix("torch.")
        log(f"reference: transformers in {engine_dtype} too, for docs/design.md §3's bar")
        peer = score_reference(
            "transformers", deployment, pairs, tokens,
            device=sweep.reference_device, dtype=engine_dtype,
        )  # fmt: skip
        peer_error = float(np.abs(np.stack(peer.outputs["score"]) - expected).max())
        threshold = allowed_score_error(peer_error)
        rule = (
            f"|raw logit - reference| <= {FLOOR_FACTOR} x transformers {engine_dtype}'s largest "
            f"on these pairs ({peer_error:.3e}) + {FLOOR_SLACK} = {threshold:.3e}"
        )
    if threshold is None:
        fp32 = deployment.dtype == torch.float32 and not deployment.int8_linears
        threshold = MAX_SCORE_DIFF_FP32 if fp32 else MAX_SCORE_DIFF_16BIT
    report = ScoreReport(
        model=str(deployment.folder.path),
        reference=ref.description,
        engine=f"pipepool, {str(deployment.dtype).removeprefix('torch.')} on "
        f"{deployment.devices[0].split(':')[0]}",
        max_score_diff=threshold,
        query=query,
        prompt_tokens=lengths,
        prompt_previews=[_preview(d) for d in documents],
        rule=rule,
    )
    for pp in sweep.pps:
        for budget in sweep.budgets:
            log(f"pp={pp} tokens={budget}")
            config = base.replace(pipeline_parallel_size=pp, max_num_batched_tokens=budget)
            row = ScoreRow(pp=pp, max_num_batched_tokens=budget, pairs=len(lengths))
            report.rows.append(_run_config(config, row, pairs, expected, lengths, threshold))
    return report


def _run_config(config, row: ScoreRow, pairs, expected, lengths, threshold) -> ScoreRow:
    t0 = time.perf_counter()
    try:
        with Engine.from_config(config) as engine:
            engine.pipeline.wait_until_compiled(None)  # (as parity/sweep.py)
            if pairs[0]:
                submission = engine.submit_pairs(*pairs, use_activation=False, long_inputs="error")
            else:
                submission = engine.submit_classify(
                    pairs[1], use_activation=False, long_inputs="error"
                )
            got = submission.result()
            row.chunked = engine.stats.chunked_requests
    except Exception as exc:  # a failed configuration is a row, not the end of the run
        row.error = f"{type(exc).__name__}: {exc}"
        row.seconds = time.perf_counter() - t0
        return row
    row.seconds = time.perf_counter() - t0
    diff = np.abs(got.astype(np.float64) - expected.astype(np.float64)).max(axis=1)
    diff = np.where(np.isfinite(diff), diff, np.inf)
    row.worst_pair = int(np.argmax(diff))
    row.worst_pair_tokens = lengths[row.worst_pair]
    row.max_abs_diff = float(diff[row.worst_pair])
    if pairs[0]:
        row.same_order = same_order(got[:, 0], expected[:, 0], threshold)
    row.passed = row.max_abs_diff <= threshold and row.same_order is not False
    return row


def allowed_score_error(peer_error: float) -> float:
    """docs/design.md §3's bar carried to raw logits: the largest ``|engine - reference|`` a 16-bit
    engine may reach, from transformers' own largest 16-bit error on the same pairs. Over the
    pairs, not per pair: one scalar's 16-bit error can land near zero by chance, which would
    make a per-pair bar a lottery."""
    return FLOOR_FACTOR * peer_error + FLOOR_SLACK


def same_order(got: np.ndarray, expected: np.ndarray, tolerance: float) -> bool:
    """Whether ``got`` ranks every two documents as ``expected`` does, wherever the expected
    scores are more than ``2 * tolerance`` apart (closer ones may swap within the tolerance)."""
    apart = expected[:, None] - expected[None, :] > 2 * tolerance  # [i, j]: i clearly above j
    return bool((got[:, None] > got[None, :])[apart].all())


def _cells(r: ScoreRow) -> tuple[str, ...]:
    if r.error is not None:
        return (r.config, str(r.pairs), str(r.chunked), "-", "-", "-", f"{r.seconds:.2f}",
                f"ERROR {r.error}")  # fmt: skip
    order = {None: "-", True: "same", False: "DIFFERS"}[r.same_order]
    return (
        r.config,
        str(r.pairs),
        str(r.chunked),
        _num(r.max_abs_diff, 2, exp=True),
        f"#{r.worst_pair} ({r.worst_pair_tokens} tok)",
        order,
        f"{r.seconds:.2f}",
        "ok" if r.passed else "FAIL",
    )


def _preview(text: str, chars: int = 48) -> str:
    return text if len(text) <= chars else text[: chars - 3] + "..."
