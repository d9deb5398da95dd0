"""Which replica takes which rows of a batch: fewest outstanding tokens first.

A batch smaller than ``min_tokens`` goes whole to the least-loaded replica (an HTTP request of
a few texts: splitting it would only add messages). A larger one is cut into contiguous row
ranges that fill the replicas up to one common level of outstanding tokens ("water filling"),
so a large ``embed`` call keeps every replica busy and finishes on all of them at about the
same time. Work per batch, not per row: a few numpy operations whatever the batch holds.
"""

from __future__ import annotations

import numpy as np


def split_rows(
    lengths: np.ndarray, loads: np.ndarray, min_tokens: int
) -> list[tuple[int, int, int]]:
    """``(replica, lo, hi)`` row ranges covering ``lengths`` in order (no empty range), for
    replicas with ``loads`` outstanding tokens each (indices into ``loads``)."""
    n = len(lengths)
    order = np.argsort(loads, kind="stable")
    cum = np.cumsum(lengths)
    total = int(cum[-1]) if n else 0
    pieces = int(min(len(loads), n, max(1, total // max(min_tokens, 1))))
    if pieces <= 1:
        return [(int(order[0]), 0, n)]
    chosen = order[:pieces]
    level_loads = loads[chosen].astype(np.float64)
    while True:  # drop replicas already above the common level: they get nothing
        level = (level_loads.sum() + total) / len(level_loads)
        keep = level_loads < level
        if keep.all():
            break
        chosen, level_loads = chosen[keep], level_loads[keep]
    shares = level - level_loads  # tokens each takes; sums to total
    # Row boundaries nearest to the token boundaries of the shares.
    bounds = np.searchsorted(cum, np.cumsum(shares)[:-1], side="left") + 1
    edges = np.concatenate([[0], np.clip(bounds, 0, n), [n]])
    edges = np.maximum.accumulate(edges)
    return [
        (int(chosen[k]), int(edges[k]), int(edges[k + 1]))
        for k in range(len(chosen))
        if edges[k + 1] > edges[k]
    ]
