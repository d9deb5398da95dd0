"""What the pair options of ``score`` / ``rerank`` mean around the tokenizer: which end a
truncated prompt keeps, which options a late-interaction model refuses, and how Cohere's
chunked documents get one score each."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import InvalidInputError

if TYPE_CHECKING:
    from ..loading.deployment import Deployment


def best_chunk_scores(scores: np.ndarray, owners: np.ndarray) -> np.ndarray:
    """Each pair's best chunk score (Cohere: a chunked document scores as its best chunk);
    ``owners``: each chunk's pair index, ascending, every pair present."""
    starts = np.flatnonzero(np.r_[True, owners[1:] != owners[:-1]])
    return np.maximum.reduceat(scores, starts)


def refuse_for_late_interaction(deployment: Deployment, **asked: bool) -> None:
    """A ColBERT or BGE-M3 model scores a pair from the query's and the document's own
    outputs, each cut to its own limit: the pair options that shape one joint prompt have no
    meaning there. Refuses the first one ``asked`` for."""
    for name, given in asked.items():
        if given:
            raise InvalidInputError(
                f"{name} shapes the joint prompt of a cross-encoder; this model "
                f"({deployment.folder.architecture}) scores query and document from their own "
                "outputs (late interaction), each truncated at its end to its limit",
                param=name,
            )


def kept_end(truncation_side: str) -> str:
    """The tokens a truncated input keeps: its first ("right") or its last ("left")."""
    if truncation_side not in ("right", "left"):
        raise InvalidInputError(
            "truncation_side must be 'right' or 'left'", param="truncation_side"
        )
    return "first" if truncation_side == "right" else "last"
