"""The one-token call a pipeline runs where it needs fresh figures from every stage (after the
stages switched to compiled bodies; for up-to-date busy times): built by the pipeline itself
from its deployment, so that no front end has to make one for it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ..core.request import PoolingParams
from ..core.submission import Submission
from ..intake.inputs import TokenSlice

if TYPE_CHECKING:
    from ..loading.deployment import Deployment


def probe_call(
    deployment: Deployment, on_cancel: Callable[[Submission], None]
) -> tuple[Submission, TokenSlice]:
    """A one-token call (not yet enqueued) that runs one step through every stage: token id 0,
    LAST pooling with the model's own normalisation; ``on_cancel``: the pipeline's cancel."""
    params = PoolingParams(pooling="last", normalize=deployment.normalize, dimensions=None)
    submission = Submission(params, 1, deployment.output_dim, on_cancel=on_cancel)
    return submission, TokenSlice(0, np.zeros(1, np.int64), np.ones(1, np.int64))
