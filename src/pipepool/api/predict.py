"""A sequence classifier's label scores for texts and text pairs mixed in one call
(``Engine.submit_classify`` with pairs in it), as text-embeddings-inference's ``/predict`` takes
them: each input is one text or a (text, text) pair, through the tokenizer's pair template (NLI
models, cross-encoders with several labels). One engine submission for the whole call, in input
order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InvalidInputError

if TYPE_CHECKING:
    from ..core.submission import Submission
    from .scoring import Scorer

TextOrPair = str | tuple[str, str]


def submit_predict(
    scorer: Scorer,
    inputs: Sequence[TextOrPair],
    *,
    use_activation: bool = True,
    truncate_prompt_tokens: int | None = None,
    long_inputs: str | None = None,
    truncation_side: str = "right",
) -> Submission:
    """Enqueue texts and pairs to classify (the caller has checked the model classifies); the
    future's result is ``[n, num_labels]``: the model's activation of its logits
    (``use_activation=False``: the logits). ``long_inputs``: "truncate" or "error" (None: the
    engine's policy, chunking read as truncation: a score is computed on one window).
    ``truncation_side`` "left" keeps a long text's end; pairs are cut longest-first from their
    ends only (Hugging Face's default), so "left" is refused for a call with a pair in it."""
    params = scorer._score_params(use_activation)
    policy = scorer._policy(long_inputs)
    limit = scorer._limit(truncate_prompt_tokens, long_inputs)
    singles = [i for i, x in enumerate(inputs) if isinstance(x, str)]
    pairs = [i for i, x in enumerate(inputs) if not isinstance(x, str)]
    if pairs and truncation_side != "right":
        raise InvalidInputError(
            "truncation_direction 'left' applies to single texts; a pair is cut longest-first "
            "from the ends of its texts: send 'right' (the default) with pairs",
            param="truncation_direction",
        )
    ids: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * len(inputs)
    types: list[np.ndarray | None] = [None] * len(inputs)
    if singles:
        texts = [inputs[i] for i in singles]
        for part in scorer.inputs.token_slices(
            texts,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
            long_inputs=policy,
        ):
            rows = np.split(part.token_ids, np.cumsum(part.lengths)[:-1])
            for k, row in enumerate(rows):
                ids[singles[part.first + k]] = row
    if pairs:
        encoded = scorer._pair_encoder.encode(
            [inputs[i][0] for i in pairs], [inputs[i][1] for i in pairs], limit=limit
        )
        cuts = np.cumsum(encoded.lengths)[:-1]
        rows = np.split(encoded.token_ids, cuts)
        row_types = np.split(encoded.type_ids, cuts) if encoded.type_ids is not None else None
        for k, i in enumerate(pairs):
            ids[i] = rows[k]
            types[i] = row_types[k] if row_types is not None else None
    lengths = np.array([len(row) for row in ids], dtype=np.int64)
    type_ids = None
    if any(t is not None for t in types):
        type_ids = np.concatenate(
            [
                t if t is not None else np.zeros(len(row), np.int64)
                for t, row in zip(types, ids, strict=True)
            ]
        )
    return scorer.engine.submit_tokens(np.concatenate(ids), lengths, params, type_ids)
