"""The embedding half of the ``Engine``: ``submit``'s validation, tokenisation and enqueueing
a slice at a time (``Engine.submit`` states the contract), over-long inputs as windows
(``long_inputs="chunk"``), and one future per call (``Submission``)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..config import EngineConfig, check_long_inputs
from ..core.priority import current_client, is_background
from ..core.request import PoolingParams
from ..core.submission import ResultCallback, Submission
from ..intake.inputs import InputPreparer, TokenSlice
from ..intake.long_inputs import CombinedSubmission, split_windows, window_params
from .scoring import refuse_embedding

if TYPE_CHECKING:
    from ..driver.pipeline import Pipeline
    from ..intake.token_budget import TokenBudget
    from ..loading.deployment import Deployment
    from .engine_info import EngineInfo


def _nothing() -> None:
    """After a slice is enqueued: nothing to wait for."""


class Embedder:
    """Turns a call's inputs into token slices and enqueues them on the pipeline, returning the
    call's future (``Engine.submit`` and ``Engine.submit_tokens`` are this object's).
    Thread-safe: it holds no per-call state."""

    def __init__(
        self,
        pipeline: Pipeline,
        deployment: Deployment,
        inputs: InputPreparer,
        config: EngineConfig,
        info: EngineInfo,
    ) -> None:
        self.pipeline = pipeline
        self._deployment = deployment
        self._inputs = inputs
        self.config = config
        self.info = info

    def submit(
        self,
        inputs,
        *,
        pooling: str | None = None,
        dimensions: int | None = None,
        normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: str = "right",
        prompt_name: str | None = None,
        long_inputs: str | None = None,
        budget: TokenBudget | None = None,
    ) -> Submission | CombinedSubmission:
        """``Engine.submit``."""
        refuse_embedding(self.info, pooling)
        params = self._inputs.params(pooling or self._deployment.pooling, dimensions, normalize)
        policy = check_long_inputs(long_inputs or self.config.long_inputs)
        items = self._inputs.items(inputs)
        slices = self._inputs.token_slices(
            items,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
            prompt_name=prompt_name,
            long_inputs=policy,
            budget=budget,
        )
        if (
            not isinstance(inputs, str)
            and isinstance(inputs, (Sequence, np.ndarray))
            and not len(inputs)
        ):
            return self._new_submission(params, 0)  # already done: an empty result
        first = next(slices)  # options (and every text) validated before anything is enqueued
        if policy == "chunk":
            return self._submit_windows(params, [first, *slices])
        submission = self._new_submission(params, len(items))
        more = len(first.lengths) < len(items)
        try:
            with (
                self.pipeline.slice_intake()
                if more
                else contextlib.nullcontext(_nothing) as enqueued
            ):
                for part in itertools.chain([first], slices):
                    self.pipeline.enqueue(submission, part)
                    if part.first + len(part.lengths) < len(items):
                        enqueued()  # before preparing the next slice
        except BaseException:
            submission.cancel()
            raise
        return submission

    def _submit_windows(
        self, params: PoolingParams, parts: list[TokenSlice]
    ) -> Submission | CombinedSubmission:
        """long_inputs="chunk": inputs over max_model_len become several requests."""
        token_ids = np.concatenate([p.token_ids for p in parts])
        lengths = np.concatenate([p.lengths for p in parts])
        d = self._deployment
        size = min(d.max_model_len, d.kv_cache_tokens) if d.causal else d.max_model_len
        windows = split_windows(token_ids, lengths, size)
        if len(windows.lengths) == len(lengths):  # nothing to split
            return self.submit_tokens(token_ids, lengths, params)
        inner = self.submit_tokens(token_ids, windows.lengths, window_params(params))
        return CombinedSubmission(inner, windows, params)

    def submit_tokens(
        self,
        token_ids: np.ndarray,
        lengths: np.ndarray,
        params: PoolingParams,
        type_ids: np.ndarray | None = None,
        key_lens: np.ndarray | None = None,
        *,
        on_result: ResultCallback | None = None,
    ) -> Submission:
        """``Engine.submit_tokens``."""
        if key_lens is not None:
            key_lens = self._inputs.key_lengths(key_lens, lengths)
        submission = self._new_submission(params, len(lengths), on_result)
        part = TokenSlice(0, token_ids, lengths, type_ids, key_lens)
        self.pipeline.enqueue(submission, part)
        return submission

    def _new_submission(
        self,
        params: PoolingParams,
        num_inputs: int,
        on_result: ResultCallback | None = None,
    ) -> Submission:
        width = params.dimensions or self._inputs.output_width(params.pooling)
        return Submission(
            params,
            num_inputs,
            width,
            on_cancel=self.pipeline.cancel,
            background=is_background(),
            client=current_client(),
            on_result=on_result,
        )
