"""TEI's ``POST /predict``: a sequence classifier's label scores, highest first, for one text,
one pair of texts, or a batch of texts and pairs (``Engine.submit_classify``), with TEI's
``raw_scores``, ``truncate`` and ``truncation_direction``."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Request, Response

from ...api.engine import Engine
from ...core.submission import Submission
from ..errors import EMPTY, APIError
from ..limits import bounded_scoring, check_input_count
from ..tei_protocol import TEIPrediction, TEIPredictRequest, long_inputs_of
from .answers import json_answer
from .shared import (
    CLIENT_CLOSED,
    ClientGone,
    check_task,
    select_model,
    state_of,
    unless_client_leaves,
)
from .tei import TEI_ERRORS

router = APIRouter(tags=["TEI"])


@router.post(
    "/predict",
    response_model=list[TEIPrediction] | list[list[TEIPrediction]],
    responses=TEI_ERRORS,
)
async def predict(body: TEIPredictRequest, request: Request) -> Response:
    """Each label's score (the model's activation; ``raw_scores``: its logits), highest
    first: a list for one text or pair, a list of such lists for a batch."""
    sequences, batch = body.sequences()
    model = select_model(request, None, "classify")
    check_task(model, "classify")
    check_input_count(state_of(request).settings, len(sequences), "inputs")
    for i, seq in enumerate(sequences):
        if seq == "" or seq == ("", ""):
            where = f"`inputs` {i}" if batch else "`inputs`"
            raise APIError(400, f"{where} cannot be empty", param="inputs", code=EMPTY)

    def submit(engine: Engine) -> Submission:
        return engine.submit_classify(
            sequences,
            use_activation=not body.raw_scores,
            long_inputs=long_inputs_of(body.truncate),
            truncation_side=body.side(),
        )

    n = len(sequences)
    bounded = bounded_scoring(state_of(request).settings, n, None, submit, "inputs")
    texts = [t for seq in sequences for t in ((seq,) if isinstance(seq, str) else seq)]
    try:
        done = await unless_client_leaves(request, model.front.run(n, bounded, texts))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    head = model.front.engine.info.classifier
    assert head is not None, "submit_classify refuses a model without a classifier"
    scores = done.matrix().astype(np.float32, copy=False)
    answers = [_predictions(row, head.labels) for row in scores]
    return await json_answer(request, lambda: answers if batch else answers[0], scores.size)


def _predictions(scores: np.ndarray, labels: tuple[str, ...]) -> list[dict]:
    """One input's labels with their scores, highest first (ties: label order)."""
    order = np.argsort(-scores, kind="stable")
    return [{"score": float(scores[i]), "label": labels[i]} for i in order.tolist()]
