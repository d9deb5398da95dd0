"""Checks of a /metrics text by the Prometheus text format's rules, with prometheus_client's
own parser: each family's HELP and TYPE once, its samples together, each series once."""

from __future__ import annotations

from collections import Counter

from prometheus_client.parser import text_string_to_metric_families


def assert_valid_and_unique(text: str) -> dict[tuple[str, frozenset], float]:
    """Every series of ``text`` (sample name and labels) -> its value; fails on a family whose
    HELP or TYPE comes twice or whose samples are split, and on a series written twice."""
    heads = Counter(tuple(line.split(" ", 3)[1:3]) for line in text.splitlines()
                    if line.startswith(("# HELP ", "# TYPE ")))  # fmt: skip
    assert [h for h, n in heads.items() if n > 1] == [], "HELP or TYPE repeated"
    families = list(text_string_to_metric_families(text))
    names = Counter(f.name for f in families)
    assert [n for n, k in names.items() if k > 1] == [], "a family's samples are split"
    series: Counter[tuple[str, frozenset]] = Counter()
    values = {}
    for family in families:
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            series[key] += 1
            values[key] = sample.value
    assert [s for s, n in series.items() if n > 1] == [], "a series written twice"
    return values
