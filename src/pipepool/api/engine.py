"""The Engine: the one object every front end (Python API, CLI, HTTP server) sits on.

A facade: it turns a call's inputs into validated token slices (``inputs``), hands them to its
``Pipeline`` (one pipeline of stages, or replicas of it: ``driver/pipeline.py``) and returns the
call's future. Everything behind the first token batch — scheduling, stages, healing,
tracing — is the pipeline's.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..config import EngineConfig, check_long_inputs
from ..core.priority import current_client, is_background
from ..core.request import PoolingParams
from ..core.stats import EngineStats
from ..core.submission import ResultCallback, Submission
from ..driver.pipeline import Pipeline
from ..errors import InvalidInputError
from ..intake.images import image_inputs
from ..intake.inputs import InputPreparer, TokenSlice
from ..intake.long_inputs import CombinedSubmission, split_windows, window_params
from ..loading.deployment import Deployment
from ..runtime.memory import bound_heap_growth
from .cross_encoder import CrossEncoderMethods
from .images import VisionTower, open_vision_tower, submit_images
from .late_chunking import late_chunk_texts
from .retrieval import RetrievalMethods
from .scoring import ScoringMethods, refuse_embedding
from .st_compat import SentenceTransformerMethods

if TYPE_CHECKING:
    from ..intake.token_budget import TokenBudget
    from ..tracing import TraceSummary

log = logging.getLogger("pipepool")
# At interpreter exit a loop thread still inside a step is waited for this long: the
# interpreter's teardown under a running torch op aborts the process (see _close_at_exit).
_EXIT_JOIN_S = 10.0
_open_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


def open_pipeline(config: EngineConfig) -> Pipeline:
    """The pipeline an EngineConfig asks for: replicas when ``data_parallel_size`` > 1
    (imported only then: one pipeline needs none of the replicas' modules)."""
    if config.data_parallel_size > 1:
        from ..replicas.pipeline import ReplicaPipeline

        return ReplicaPipeline(config)
    from ..driver.local import LocalPipeline

    return LocalPipeline(config)


def _nothing() -> None:
    """After a slice is enqueued: nothing to wait for."""


class Engine(ScoringMethods, CrossEncoderMethods, SentenceTransformerMethods, RetrievalMethods):
    """Embeds text or token ids with a pooling model, optionally split into pipeline stages;
    scores, reranks and classifies with a classifier (``ScoringMethods``); offers
    sentence-transformers' ``SentenceTransformer`` and ``CrossEncoder`` methods and attributes
    with their semantics (``SentenceTransformerMethods``, ``CrossEncoderMethods``); gives
    sparse and multi-vector outputs where the model has them (``RetrievalMethods``).

    Every method is thread-safe and may be called concurrently; results come back in input
    order. Use as a context manager, or call ``close()``. Keyword options are the fields of
    ``EngineConfig`` (``max_num_batched_tokens``, ``pipeline_parallel_size``, ...);
    ``data_parallel_size=N`` runs N replicas of the pipeline behind the same methods.
    ``pipeline`` is what computes (``driver.pipeline.Pipeline``).
    """

    def __init__(self, model: str | None = None, **options) -> None:
        self._start(EngineConfig.from_options(model=model, **options))

    @classmethod
    def from_config(cls, config: EngineConfig, pipeline: Pipeline | None = None) -> Engine:
        """An engine for ``config``; ``pipeline``: one already started for it (shared
        replicas of several front-end processes), else the one the config asks for."""
        engine = object.__new__(cls)
        engine._start(config, pipeline)
        return engine

    def _start(self, config: EngineConfig, pipeline: Pipeline | None = None) -> None:
        self._trace_written = True  # until started, close() has no trace to write
        bound_heap_growth()  # before the first large block: RSS stays flat however long we run
        self.config = config
        self.pipeline: Pipeline = pipeline if pipeline is not None else open_pipeline(config)
        self.deployment: Deployment = self.pipeline.deployment
        self.inputs = InputPreparer(self.deployment)
        # A dual encoder's vision tower (api/images.py): a pipeline of its own, for images.
        self._vision: VisionTower | None = None
        if config.tower == "text" and pipeline is None:
            try:
                self._vision = open_vision_tower(config, self.deployment, open_pipeline)
            except BaseException:
                self.pipeline.close()
                raise
        self._trace_written = False
        _open_engines.add(self)

    @property
    def stats(self) -> EngineStats:
        """The engine's counters now (every replica's, summed, for replicas): a snapshot,
        which later work leaves unchanged, on every kind of pipeline."""
        return self.pipeline.stats.snapshot()

    # -- public API -------------------------------------------------------------------------

    @property
    def model_path(self) -> str:
        return str(self.deployment.folder.path)

    def embed(
        self,
        inputs: str | Sequence[str] | Sequence[Sequence[int]],
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: str = "right",
        prompt_name: str | None = None,
        long_inputs: str | None = None,
        late_chunking: bool = False,
    ) -> np.ndarray:
        """One vector per input, ``[n, dim]`` float32, in input order (``[0, dim]`` for no
        input). A dual encoder (CLIP, SigLIP) also embeds images: PIL images, bytes or
        ``pathlib.Path``s under ``allowed_local_media_path``, one modality per call
        (``api/images.py``). ``late_chunking``: the inputs are consecutive chunks of one
        document, run through the model together and pooled chunk by chunk
        (``late_chunking.py`` states the rule; documents longer than the model's context are
        split into overlapping windows)."""
        if late_chunking:
            if image_inputs(inputs) is not None:
                raise InvalidInputError(
                    "late_chunking pools chunks of one text; images cannot be late-chunked",
                    param="late_chunking",
                )
            return late_chunk_texts(
                self,
                inputs,
                dimensions=dimensions,
                normalize=normalize,
                truncate_prompt_tokens=truncate_prompt_tokens,
                truncation_side=truncation_side,
                prompt_name=prompt_name,
                long_inputs=long_inputs,
            ).vectors
        return self.submit(
            inputs,
            dimensions=dimensions,
            normalize=normalize,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
            prompt_name=prompt_name,
            long_inputs=long_inputs,
        ).result()

    def embed_tokens(
        self,
        inputs: str | Sequence[str] | Sequence[Sequence[int]],
        *,
        normalize: bool = False,
        truncate_prompt_tokens: int | None = None,
        truncation_side: str = "right",
        prompt_name: str | None = None,
        long_inputs: str | None = None,
    ) -> list[np.ndarray]:
        """Token embeddings (ALL pooling): one ``[len, hidden]`` float32 array per input."""
        return self.pool(
            inputs,
            pooling="all",
            normalize=normalize,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
            prompt_name=prompt_name,
            long_inputs=long_inputs,
        )

    def pool(self, inputs, *, pooling: str, **kwargs) -> list[np.ndarray]:
        """Any pooling (last | mean | cls | all) for a batch of inputs; blocks until done.
        One array per input; ``kwargs`` as for ``submit``."""
        return list(self.submit(inputs, pooling=pooling, **kwargs).result())

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
        """Validate, tokenise and enqueue; returns the call's future once every input is
        enqueued. ``budget``: the most tokens the call may have (``TokenBudget``; a server's
        request limits), counted on the slices tokenised here.

        Raises InvalidInputError naming the input if any input is bad; then nothing of the
        call stays queued (slices already enqueued are cancelled). Long lists are tokenised
        and enqueued a slice at a time, so the device starts on the first slice while this
        thread tokenises the next, paced by the pipeline's ``slice_intake``.
        ``long_inputs`` overrides the engine's policy for inputs over max_model_len.
        """
        refuse_embedding(self.deployment, pooling)
        images = image_inputs(inputs)
        if images is not None:
            return submit_images(
                self._vision, self.inputs, images, pooling=pooling, dimensions=dimensions,
                normalize=normalize, truncate_prompt_tokens=truncate_prompt_tokens,
                truncation_side=truncation_side, prompt_name=prompt_name,
                long_inputs=long_inputs,
            )  # fmt: skip
        params = self.inputs.params(pooling or self.deployment.pooling, dimensions, normalize)
        policy = check_long_inputs(long_inputs or self.config.long_inputs)
        items = self.inputs.items(inputs)
        slices = self.inputs.token_slices(
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
        d = self.deployment
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
        """Enqueue prompts already validated by ``self.inputs`` (back to back), with the token
        type ids of pair inputs if any; ``on_result``: the submission's (``Submission``), there
        before the first step can finish a row.

        ``key_lens`` (one per prompt; bidirectional models whose attention honours them, see
        ``InputPreparer.key_lengths``, which checks them here): prompt i's attention keys are
        its first ``key_lens[i]`` tokens; every token, those after included, still attends
        over them and has an output (ColBERT's query expansion: [MASK] padding with attention
        mask 0, as Hugging Face computes it for ``attention_mask = [1] * k + [0] * (n - k)``).
        0: every token is a key. Raises InvalidInputError naming a bad one."""
        if key_lens is not None:
            key_lens = self.inputs.key_lengths(key_lens, lengths)
        submission = self._new_submission(params, len(lengths), on_result)
        part = TokenSlice(0, token_ids, lengths, type_ids, key_lens)
        self.pipeline.enqueue(submission, part)
        return submission

    def tokenize(self, inputs, **kwargs) -> list[np.ndarray]:
        """Token ids per input, as ``submit`` would enqueue them (truncation included)."""
        kwargs.setdefault("long_inputs", self.config.long_inputs)
        return self.inputs.prepare(inputs, **kwargs)

    def wait_until_compiled(self, timeout: float | None = None) -> bool:
        """Block until every stage computes with its compiled layer bodies; False if that
        takes longer than ``timeout`` seconds. Where ``compile`` is left to the engine it is
        ready, and serves, while it compiles (README, "Start-up"); a benchmark waits here."""
        return self.pipeline.wait_until_compiled(timeout)

    def stage_busy_s(self) -> list[float]:
        """Seconds each stage has spent computing so far (for idle fractions; replica-major
        with replicas)."""
        return self.pipeline.stage_busy_s()

    @property
    def kv_blocks_free(self) -> int | None:
        """Free KV-cache blocks now (None where the model keeps no KV cache)."""
        return self.pipeline.kv_blocks_free

    @property
    def kv_blocks_total(self) -> int:
        """KV-cache blocks of the pipeline (every replica's; 0 without a KV cache)."""
        return self.pipeline.kv_blocks_total

    @property
    def is_alive(self) -> bool:
        """False once closed, or once the pipeline failed for good (even with no request in
        flight); True while a failed pipeline is being restarted."""
        return self.health in ("ok", "degraded")

    @property
    def health(self) -> str:
        """ok | degraded (a stage or replica died and is being restarted; calls wait) | dead |
        closed."""
        return self.pipeline.health

    def replica_status(self) -> list:
        """Per replica: state, pid, devices, load, queue, tokens/s, busy fraction, restarts
        (``replicas.stats.ReplicaStatus``); empty for one pipeline."""
        return self.pipeline.replica_status()

    def add_death_callback(self, fn: Callable[[BaseException], None]) -> None:
        """``fn(cause)`` once the engine fails for good (not on ``close()``); called on the
        thread that saw the failure, or at once if it is dead already."""
        self.pipeline.add_death_callback(fn)

    def write_trace(
        self,
        path: str | None = None,
        *,
        since_ns: int | None = None,
        until_ns: int | None = None,
        timeout: float | None = 300.0,
    ) -> TraceSummary:
        """Write the step timeline so far to ``path`` (default: ``config.trace``) as Chrome
        trace events and return where each stage's time went. ``since_ns`` / ``until_ns``
        (``time.monotonic_ns()`` of this process) keep only that window. Waits for the plans
        in flight to finish; new plans wait meanwhile. Tracing must be on (``trace=``). With
        replicas, every replica's processes are in the file, and the summary lists the stages
        of each."""
        from ..tracing import summarize_pipelines
        from ..tracing.chrome import write_chrome_trace

        if not self.pipeline.tracing:
            raise InvalidInputError("tracing is off: start the engine with trace=FILE.json")
        per_pipeline = self.pipeline.gather_trace(timeout)
        summary, traces = summarize_pipelines(per_pipeline, since_ns, until_ns)
        target = path or self.config.trace
        assert target is not None, "tracing is on: config.trace names its file"
        write_chrome_trace(target, traces, since_ns, until_ns)
        self._trace_written = True
        return summary

    def close(self, *, write_trace: bool = True) -> None:
        """Stop the pipeline and every stage process now (well under a second); pending calls
        fail with EngineDeadError("engine closed"). With tracing on and no trace written yet,
        the steps in flight finish first and the trace is written (its summary logged), unless
        ``write_trace`` is False."""
        if write_trace and not self._trace_written and self.pipeline.tracing and self.is_alive:
            try:
                summary = self.write_trace(timeout=60)
                log.info("%s\ntrace written to %s", summary.text(), self.config.trace)
            except Exception as exc:  # the trace must not keep the engine from closing
                log.warning("could not write the trace: %r", exc)
        self._trace_written = True
        self.pipeline.close()
        vision = getattr(self, "_vision", None)  # None too where _start failed early
        if vision is not None:
            vision.close()
        self.inputs.tokenizer.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # Not contextlib.suppress: at interpreter exit module globals may already be None.
        try:  # noqa: SIM105
            self.close()
        except Exception:
            pass

    def _new_submission(
        self,
        params: PoolingParams,
        num_inputs: int,
        on_result: ResultCallback | None = None,
    ) -> Submission:
        width = params.dimensions or self.inputs.output_width(params.pooling)
        return Submission(
            params,
            num_inputs,
            width,
            on_cancel=self.pipeline.cancel,
            background=is_background(),
            client=current_client(),
            on_result=on_result,
        )


@atexit.register
def _close_at_exit() -> None:
    """Close the engines a program left open. Without this a program that exits with work
    in flight (no close(), no ``with``) dies of SIGABRT ("terminate called without an active
    exception", exit code 134): the interpreter tears down while the loop thread still runs a
    step's torch ops. Runs before the interpreter's own teardown."""
    for engine in list(_open_engines):
        with contextlib.suppress(Exception):
            engine.close()
            engine.pipeline.close(join_timeout=_EXIT_JOIN_S)
