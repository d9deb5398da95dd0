"""The parity report: a table for people, the same content as JSON for machines."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .compare import Row

_COLUMNS = (
    "configuration",
    "requests",
    "chunked",
    "min cosine",
    "mean cosine",
    "worst request",
    "max |diff|",
    "seconds",
    "result",
)


@dataclass
class ParityReport:
    """A parity run: the prompts, the reference and threshold, and one ``Row`` per
    configuration tried; it passes when every row does."""

    model: str
    reference: str  # what the engine was compared with, in words
    engine: str  # dtype and device of the engines under test
    min_cosine: float  # the pass threshold, per request
    prompt_tokens: list[int]  # length of each prompt, special tokens included
    prompt_previews: list[str]  # the first characters of each prompt
    rows: list[Row] = field(default_factory=list)
    # docs/design.md §3's bar in words where it judges the rows (min_cosine is then reported only)
    rule: str | None = None
    # Page retrievers' MaxSim rows: the largest |engine - reference| per query-page pair
    max_sim_diff: float | None = None

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.passed for r in self.rows)

    def failures(self) -> list[Row]:
        return [r for r in self.rows if not r.passed]

    def to_dict(self) -> dict:
        """JSON-ready: non-finite numbers become null (strict JSON has no NaN)."""
        return _finite(
            {
                "model": self.model,
                "reference": self.reference,
                "engine": self.engine,
                "min_cosine": self.min_cosine,
                "rule": self.rule,
                "max_sim_diff": self.max_sim_diff,
                "passed": self.passed,
                "prompts": [
                    {"index": i, "tokens": n, "preview": text}
                    for i, (n, text) in enumerate(
                        zip(self.prompt_tokens, self.prompt_previews, strict=True)
                    )
                ],
                "rows": [{"configuration": r.config, **asdict(r)} for r in self.rows],
            }
        )

    def header(self) -> str:
        lengths = self.prompt_tokens
        return (
            f"model:     {self.model}\n"
            f"engine:    {self.engine}\n"
            f"reference: {self.reference}\n"
            f"prompts:   {len(lengths)} ({min(lengths)}..{max(lengths)} tokens: "
            f"{', '.join(map(str, lengths))})\n"
            f"pass:      {self.rule or f'cosine >= {self.min_cosine} for every request'}"
            " (every token for pooling 'all')"
            + (
                f"; |MaxSim - reference| <= {self.max_sim_diff:.3e} for every query-page pair"
                if self.max_sim_diff is not None
                else ""
            )
        )

    def table(self) -> str:
        """A Markdown table, readable in a terminal and pasteable into a README."""
        right = {1, 2, 3, 4, 6, 7}  # numbers align right
        return markdown_table([_COLUMNS, *(_cells(r) for r in self.rows)], right)

    def summary(self) -> str:
        """One line per failed configuration (naming the worst request), then the verdict."""
        lines = []
        for r in self.failures():
            if r.error is not None:
                lines.append(f"FAIL {r.config}: {r.error}")
            elif r.min_cosine is None:  # a MaxSim row: scores, not vectors
                lines.append(
                    f"FAIL {r.config}: worst pair #{r.worst_request} (query-major) is "
                    f"{_num(r.max_abs_diff, 2, exp=True)} off; the bar: |MaxSim - reference| "
                    f"<= {self.max_sim_diff}"
                )
            else:
                where = f", token {r.worst_token}" if r.worst_token is not None else ""
                bar = self.rule or f"cosine >= {self.min_cosine}"
                lines.append(
                    f"FAIL {r.config}: worst request #{r.worst_request} "
                    f"({r.worst_prompt_tokens} tokens{where}) has cosine "
                    f"{_num(r.min_cosine, 10)}; the bar: {bar}"
                )
        n = len(self.rows)
        if self.passed:
            lines.append(f"parity OK: {n} of {n} configurations pass")
        else:
            lines.append(f"parity FAILED: {len(self.failures())} of {n} configurations fail")
        return "\n".join(lines)


def markdown_table(cells: list[tuple[str, ...]], right: set[int]) -> str:
    """``cells[0]`` is the header; columns in ``right`` (numbers) align right."""
    widths = [max(len(row[c]) for row in cells) for c in range(len(cells[0]))]

    def line(row) -> str:
        parts = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "| " + " | ".join(parts) + " |"

    rule = "|" + "|".join(
        "-" * (w + 1) + ":" if i in right else "-" * (w + 2) for i, w in enumerate(widths)
    )
    return "\n".join([line(cells[0]), rule + "|", *(line(r) for r in cells[1:])])


def _cells(r: Row) -> tuple[str, ...]:
    if r.error is not None:
        dashes = ("-",) * 4
        return (r.config, str(r.requests), str(r.chunked), *dashes, f"{r.seconds:.2f}",
                f"ERROR {r.error}")  # fmt: skip
    if r.worst_prompt_tokens is None:  # a MaxSim row: pairs, numbered query-major
        worst = f"pair #{r.worst_request}"
    else:
        worst = f"#{r.worst_request} ({r.worst_prompt_tokens} tok)"
    no_cosine = r.min_cosine is None  # a MaxSim row
    return (
        r.config,
        str(r.requests),
        str(r.chunked),
        "-" if no_cosine else _num(r.min_cosine, 8),
        "-" if no_cosine else _num(r.mean_cosine, 8),
        worst,
        _num(r.max_abs_diff, 2, exp=True),
        f"{r.seconds:.2f}",
        "ok" if r.passed else "FAIL",
    )


def _num(x: float | None, digits: int, *, exp: bool = False) -> str:
    if x is None or math.isnan(x):
        return "nan"
    return f"{x:.{digits}e}" if exp else f"{x:.{digits}f}"


def _finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj
