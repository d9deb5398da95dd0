"""The Engine: the one object every front end (Python API, CLI, HTTP server) sits on.

A thin front class: it turns a call's inputs into validated token slices (``embedding.py``;
``scoring.py`` for pairs and labels, ``retrieval.py`` for sparse and multi-vector outputs),
hands them to its ``Pipeline`` (one pipeline of stages, or replicas of it:
``driver/pipeline.py``) and returns the call's future. Everything behind the first token
batch — scheduling, stages, healing, tracing — is the pipeline's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Literal, overload

import numpy as np

from ..config import EngineConfig
from ..core.request import PoolingParams
from ..core.stats import EngineStats
from ..core.submission import ResultCallback, Submission
from ..driver.pipeline import Pipeline
from ..errors import InvalidInputError
from ..intake.images import image_inputs, plain_inputs
from ..intake.inputs import InputPreparer, TokenSlice
from ..intake.long_inputs import CombinedSubmission
from ..intake.tokenizer import Tokenizer
from ..intake.tokenizer_pool import TokenizerPool, pool_size
from ..runtime.memory import bound_heap_growth
from .embedding import Embedder
from .engine_info import EngineInfo
from .images import VisionTower, open_vision_tower, submit_images
from .int8_scale import Int8Calibration
from .late_chunking import late_chunk_texts
from .lifecycle import close_at_exit, open_pipeline
from .page_retrieval import page_rerank, page_scores, refuse_page_options
from .retrieval import RetrievalEncoder, RetrievalOutputs
from .scoring import Classification, RerankResult, Scorer
from .vlm import (
    VlmInputs,
    colqwen2_inputs,
    is_multimodal_call,
    open_vlm_inputs,
    submit_multimodal,
)

if TYPE_CHECKING:
    from ..intake.token_budget import TokenBudget
    from ..tracing import TraceSummary

log = logging.getLogger("pipepool")


class Engine:
    """Embeds text or token ids with a pooling model, optionally split into pipeline stages;
    scores, reranks and classifies with a classifier; gives sparse and multi-vector outputs
    where the model has them (``encode_outputs``). ``info`` holds what the engine's model is
    and does. sentence-transformers' ``SentenceTransformer`` and ``CrossEncoder`` surfaces
    are adapters over this class (``pipepool.SentenceTransformer``, ``pipepool.CrossEncoder``),
    as is the sparse / multi-vector one (``pipepool.Retriever``).

    Every method is thread-safe and may be called concurrently; results come back in input
    order. Use as a context manager, or call ``close()``. Keyword options are the fields of
    ``EngineConfig`` (``max_num_batched_tokens``, ``pipeline_parallel_size``, ...);
    ``data_parallel_size=N`` runs N replicas of the pipeline behind the same methods.
    ``pipeline`` is what computes (``driver.pipeline.Pipeline``: its KV-cache, stage and
    replica diagnostics, ``wait_until_compiled``, death callbacks); ``config`` the
    ``EngineConfig`` it was started with; ``tokenizer`` the model's tokenizer
    (``intake.tokenizer.Tokenizer``), which every call tokenizes with.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | None = None,
        pipeline: Pipeline | None = None,
        vision_pipeline: Pipeline | None = None,
        **options,
    ) -> None:
        """``Engine(model, **options)``; or ``config=`` an ``EngineConfig`` (no ``model`` nor
        options then) and, with it, ``pipeline=`` one already started for that config (shared
        replicas of several front-end processes), and for a dual encoder ``vision_pipeline=``
        its vision tower's, started for ``config.replace(tower="vision")`` (without it such an
        engine embeds texts only)."""
        self._trace_written = True  # until started, close() has no trace to write
        if config is None:
            if pipeline is not None:
                raise InvalidInputError("pipeline= needs the config= it was started for")
            config = EngineConfig.from_options(model=model, **options)
        elif model is not None or options:
            raise InvalidInputError(
                "give either config= or a model and options, not both",
                param=next(iter(options), "model"),
            )
        bound_heap_growth()  # before the first large block: RSS stays flat however long we run
        self.config = config
        self.pipeline: Pipeline = pipeline if pipeline is not None else open_pipeline(config)
        self._deployment = self.pipeline.deployment
        self._inputs = InputPreparer(self._deployment)
        self.tokenizer: Tokenizer = self._inputs.tokenizer
        self._start_tokenizer_pool(pipeline is None)
        self.info = EngineInfo.of(self._deployment, config, self.tokenizer.vocab_size)
        self._embedder = Embedder(self.pipeline, self._deployment, self._inputs, config, self.info)
        self._scorer = Scorer(self, self._deployment, self._inputs)
        self._retrieval = RetrievalEncoder(self, self._deployment, self._inputs)
        self._int8 = Int8Calibration()
        # A dual encoder's vision tower (api/images.py): a pipeline of its own, for images.
        self._vision: VisionTower | None = None
        # A vision-language embedder's dict inputs (api/vlm.py): texts with images.
        self._vlm: VlmInputs | None = None
        try:
            self._vlm = open_vlm_inputs(config, self.pipeline)
        except BaseException:
            self.pipeline.close()
            raise
        # ColQwen2: score and rerank are MaxSim of queries against page images.
        self._pages = self._vlm is not None and self._vlm.multi_vector
        if vision_pipeline is not None or (config.tower == "text" and pipeline is None):
            opened = open_pipeline if vision_pipeline is None else lambda _: vision_pipeline
            try:
                self._vision = open_vision_tower(config, self._deployment, opened)
            except BaseException:
                self.pipeline.close()
                raise
        self._trace_written = False
        close_at_exit(self)

    def _start_tokenizer_pool(self, owns_pipeline: bool) -> None:
        """Large batches of text to helper processes (``EngineConfig.tokenizer_processes``;
        by default only where this engine owns its pipeline: front ends over a shared one
        tokenise as they choose)."""
        wanted = self.config.tokenizer_processes
        if wanted is None and not owns_pipeline:
            return
        cuda = self._deployment.devices[0].startswith("cuda")
        processes = pool_size(wanted, cuda)
        if processes:
            try:
                self.tokenizer.use_helper(TokenizerPool(self.tokenizer.file, processes))
            except BaseException:
                if owns_pipeline:
                    self.pipeline.close()
                raise

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        pipeline: Pipeline | None = None,
        vision_pipeline: Pipeline | None = None,
    ) -> Engine:
        """An engine for ``config``; ``pipeline``: one already started for it (shared
        replicas of several front-end processes), else the one the config asks for; and a dual
        encoder's ``vision_pipeline`` with it."""
        return cls(config=config, pipeline=pipeline, vision_pipeline=vision_pipeline)

    @property
    def stats(self) -> EngineStats:
        """The engine's counters now (every replica's, summed, for replicas): a snapshot,
        which later work leaves unchanged, on every kind of pipeline."""
        return self.pipeline.stats.snapshot()

    # -- embeddings -----------------------------------------------------------------------------

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
            if image_inputs(inputs) is not None or is_multimodal_call(inputs):
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
        request limits), counted on the slices tokenised here. Images (a dual encoder's):
        decoded, preprocessed and enqueued on its vision tower (``api/images.py``).

        Raises InvalidInputError naming the input if any input is bad; then nothing of the
        call stays queued (slices already enqueued are cancelled). Long lists are tokenised
        and enqueued a slice at a time, so the device starts on the first slice while this
        thread tokenises the next, paced by the pipeline's ``slice_intake``.
        ``long_inputs`` overrides the engine's policy for inputs over max_model_len.
        """
        if self._pages:  # ColQwen2: texts are queries, images pages (its processor's formats)
            inputs = colqwen2_inputs(inputs) or inputs
        # Texts or token ids alone (the common calls) need no look at each input for images
        # or dicts.
        plain = plain_inputs(inputs)
        if not plain and is_multimodal_call(inputs):
            return submit_multimodal(
                self._vlm, self._inputs, inputs, pooling=pooling, dimensions=dimensions,
                normalize=normalize, truncate_prompt_tokens=truncate_prompt_tokens,
                truncation_side=truncation_side, prompt_name=prompt_name,
                long_inputs=long_inputs, budget=budget,
            )  # fmt: skip
        images = None if plain else image_inputs(inputs)
        if images is not None:
            return submit_images(
                self._vision, self._inputs, images, pooling=pooling, dimensions=dimensions,
                normalize=normalize, truncate_prompt_tokens=truncate_prompt_tokens,
                truncation_side=truncation_side, prompt_name=prompt_name,
                long_inputs=long_inputs,
            )  # fmt: skip
        return self._embedder.submit(
            inputs, pooling=pooling, dimensions=dimensions, normalize=normalize,
            truncate_prompt_tokens=truncate_prompt_tokens, truncation_side=truncation_side,
            prompt_name=prompt_name, long_inputs=long_inputs, budget=budget,
        )  # fmt: skip

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
        """Enqueue prompts already tokenized (``tokenize``; back to back), with the token
        type ids of pair inputs if any; ``on_result``: the submission's (``Submission``), there
        before the first step can finish a row.

        ``key_lens`` (one per prompt; bidirectional models whose attention honours them, see
        ``intake.inputs.InputPreparer.key_lengths``, which checks them here): prompt i's
        attention keys are its first ``key_lens[i]`` tokens; every token, those after
        included, still attends over them and has an output (ColBERT's query expansion:
        [MASK] padding with attention mask 0, as Hugging Face computes it for
        ``attention_mask = [1] * k + [0] * (n - k)``).
        0: every token is a key. Raises InvalidInputError naming a bad one."""
        return self._embedder.submit_tokens(
            token_ids, lengths, params, type_ids, key_lens, on_result=on_result
        )

    def tokenize(self, inputs, **options) -> list[np.ndarray]:
        """Token ids per input, as ``submit`` would enqueue them (prompt and truncation
        included; ``options`` as ``submit``'s: truncate_prompt_tokens, truncation_side,
        prompt_name, long_inputs)."""
        out: list[np.ndarray] = []
        for part in self.token_slices(inputs, **options):
            out += np.split(part.token_ids, np.cumsum(part.lengths)[:-1])
        return out

    def token_slices(self, inputs, **options) -> Iterator[TokenSlice]:
        """``tokenize``'s token ids a slice of inputs at a time (``TokenSlice``: the index of
        its first input, the flat ids, one length per input), every text validated before the
        first: a caller that counts tokens stops at the first slice over its limit."""
        options.setdefault("long_inputs", self.config.long_inputs)
        return self._inputs.token_slices(inputs, **options)

    # -- scores, labels and retrieval outputs --------------------------------------------------

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        *,
        use_activation: bool = True,
        instruction: str | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: str = "right",
        long_inputs: str | None = None,
        weights: Sequence[float] | None = None,
    ) -> np.ndarray:
        """One score per pair, ``[n]`` float32, as vLLM's ``score``: one ``text_1`` against
        every ``text_2`` (one-to-many), or ``text_1[i]`` with ``text_2[i]`` (pairwise).
        ``use_activation=False`` gives the raw logits; ``instruction`` is Qwen3-Reranker's.
        A pair over its limit loses tokens from its texts' ends (``truncation_side="right"``)
        or starts ("left"), longest text first, as Hugging Face tokenizers truncate pairs.
        A ColBERT model gives MaxSim (``text_1`` the queries), BGE-M3 its
        "colbert+sparse+dense" mix by ``weights`` ([dense, sparse, colbert]; ``M3_WEIGHTS``);
        ColQwen2 MaxSim of queries against page images (``text_2``; ``page_retrieval.py``)."""
        if self._pages:
            refuse_page_options(
                instruction=instruction, truncate_prompt_tokens=truncate_prompt_tokens,
                truncation_side=None if truncation_side == "right" else truncation_side,
                long_inputs=long_inputs, weights=weights,
            )  # fmt: skip
            return page_scores(self, text_1, text_2, use_activation=use_activation)
        return self._scorer.score(
            text_1, text_2, use_activation=use_activation, instruction=instruction,
            truncate_prompt_tokens=truncate_prompt_tokens, truncation_side=truncation_side,
            long_inputs=long_inputs, weights=weights,
        )  # fmt: skip

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        top_n: int | None = None,
        return_documents: bool = False,
        instruction: str | None = None,
        max_tokens_per_doc: int | None = None,
        max_chunks_per_doc: int | None = None,
        use_activation: bool = True,
        truncate_prompt_tokens: int | None = None,
        truncation_side: str = "right",
        long_inputs: str | None = None,
        weights: Sequence[float] | None = None,
    ) -> list[RerankResult]:
        """``documents`` by relevance to ``query``, most relevant first (ties: input order);
        the first ``top_n`` of them (None or 0: all). ``max_tokens_per_doc`` cuts each document
        first, as Cohere's API does; ``max_chunks_per_doc`` scores a long document as Cohere
        does instead of truncating it: each of its first N windows beside the whole query, the
        best window's score its score (``submit_chunked_pairs``). ColBERT and BGE-M3 models
        rank as ``score`` scores (``weights``: BGE-M3's); ColQwen2 ranks page images."""
        if self._pages:
            refuse_page_options(
                return_documents=return_documents or None, instruction=instruction,
                max_tokens_per_doc=max_tokens_per_doc, max_chunks_per_doc=max_chunks_per_doc,
                truncate_prompt_tokens=truncate_prompt_tokens,
                truncation_side=None if truncation_side == "right" else truncation_side,
                long_inputs=long_inputs, weights=weights,
            )  # fmt: skip
            return page_rerank(self, query, documents, top_n=top_n, use_activation=use_activation)
        return self._scorer.rerank(
            query, documents, top_n=top_n, return_documents=return_documents,
            instruction=instruction, max_tokens_per_doc=max_tokens_per_doc,
            max_chunks_per_doc=max_chunks_per_doc, use_activation=use_activation,
            truncate_prompt_tokens=truncate_prompt_tokens, truncation_side=truncation_side,
            long_inputs=long_inputs, weights=weights,
        )  # fmt: skip

    def classify(
        self,
        texts: str | Sequence[str],
        *,
        use_activation: bool = True,
        truncate_prompt_tokens: int | None = None,
        truncation_side: str = "right",
        long_inputs: str | None = None,
    ) -> Classification:
        """Label scores per text (``[n, num_labels]``; a single string is one text): the
        model's activation (softmax for several labels, sigmoid for one, unless its
        sentence-transformers config names another), or raw logits. A truncated text keeps
        its first tokens (``truncation_side="right"``) or its last ("left")."""
        return self._scorer.classify(
            texts, use_activation=use_activation, truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side, long_inputs=long_inputs,
        )  # fmt: skip

    def classify_tokens(
        self,
        texts: str | Sequence[str],
        *,
        aggregation_strategy: str = "simple",
        truncate_prompt_tokens: int | None = None,
        long_inputs: str | None = None,
    ) -> list[list[dict]]:
        """Named entities per text, as transformers' token-classification pipeline gives them
        (its default ``ignore_labels=["O"]``): ``aggregation_strategy`` "none" (one dict per
        token: entity, score, index, word, start, end), "simple" (adjacent tokens of one type
        grouped: entity_group, score (their mean), word, start, end), or "first" / "average" /
        "max" (words labelled by their first sub-token / their sub-tokens' mean / their most
        confident sub-token, then grouped). ``start``/``end`` are character offsets into the
        text. Needs a ``*ForTokenClassification`` checkpoint."""
        return self._scorer.classify_tokens(
            texts, aggregation_strategy=aggregation_strategy,
            truncate_prompt_tokens=truncate_prompt_tokens, long_inputs=long_inputs,
        )  # fmt: skip

    def encode_outputs(
        self,
        inputs: str | Sequence[str] | Sequence[Sequence[int]],
        outputs: Sequence[str] = ("dense",),
        *,
        top_k: int | None = None,
        return_tokens: bool = False,
        is_query: bool = False,
        normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: str = "right",
        prompt_name: str | None = None,
        long_inputs: str | None = None,
    ) -> RetrievalOutputs:
        """Any subset of the model's outputs (``info.outputs``: dense, sparse, multi_vector)
        from one forward pass per input: SPLADE's and BGE-M3's sparse vectors (``top_k``: the
        k largest weights, sentence-transformers' ``max_active_dims``; ``return_tokens``: the
        tokens' strings too), ColBERT's and BGE-M3's token vectors (``is_query``: PyLate's
        query form, query prefix and [MASK] expansion, rather than the document form)."""
        return self._retrieval.encode_outputs(
            inputs, outputs, top_k=top_k, return_tokens=return_tokens, is_query=is_query,
            normalize=normalize, truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side, prompt_name=prompt_name, long_inputs=long_inputs,
        )  # fmt: skip

    # -- futures, for callers that wait their own way (the server) ----------------------------

    def submit_pairs(
        self,
        queries: Sequence[str],
        documents: Sequence[str],
        *,
        use_activation: bool = True,
        instruction: str | None = None,
        max_tokens_per_doc: int | None = None,
        max_tokens_per_query: int | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: str = "right",
        long_inputs: str | None = None,
        weights: Sequence[float] | None = None,
        per_label: bool = False,
    ) -> Submission:
        """Enqueue pairs ``(queries[i], documents[i])`` (options as ``score``'s); the future's
        result is ``[n, 1]``, or with ``per_label`` ``[n, num_labels]``: every label's score of
        a classifier (``CrossEncoder.predict``'s; else the model must have one label). A
        ColBERT or BGE-M3 model's pairs are scored before this returns (its future is done:
        ``retrieval_scoring``)."""
        return self._scorer.submit_pairs(
            queries, documents, use_activation=use_activation, instruction=instruction,
            max_tokens_per_doc=max_tokens_per_doc, max_tokens_per_query=max_tokens_per_query,
            truncate_prompt_tokens=truncate_prompt_tokens, truncation_side=truncation_side,
            long_inputs=long_inputs, weights=weights, per_label=per_label,
        )  # fmt: skip

    def submit_chunked_pairs(
        self,
        queries: Sequence[str],
        documents: Sequence[str],
        *,
        max_chunks_per_doc: int,
        use_activation: bool = True,
        instruction: str | None = None,
        max_tokens_per_doc: int | None = None,
        max_tokens_per_query: int | None = None,
        truncate_prompt_tokens: int | None = None,
        long_inputs: str | None = None,
        weights: Sequence[float] | None = None,
    ) -> tuple[Submission, np.ndarray]:
        """Cohere's chunking: each document split into windows that fit beside its whole query
        in one prompt (``truncate_prompt_tokens`` tokens, else max_model_len), its first
        ``max_chunks_per_doc`` windows enqueued as pairs. Returns the future (``[chunks, 1]``)
        and each chunk's pair index; ``pair_options.best_chunk_scores`` gives each pair its
        best score. Cross-encoders with the tokenizer's pair template only."""
        return self._scorer.submit_chunked_pairs(
            queries, documents, max_chunks_per_doc=max_chunks_per_doc,
            use_activation=use_activation, instruction=instruction,
            max_tokens_per_doc=max_tokens_per_doc, max_tokens_per_query=max_tokens_per_query,
            truncate_prompt_tokens=truncate_prompt_tokens, long_inputs=long_inputs,
            weights=weights,
        )  # fmt: skip

    def submit_classify(
        self,
        texts: str | Sequence[str | tuple[str, str]],
        *,
        use_activation: bool = True,
        truncate_prompt_tokens: int | None = None,
        truncation_side: str = "right",
        long_inputs: str | None = None,
        per_token: bool = False,
    ) -> Submission:
        """Enqueue texts to classify (options as ``classify``'s); the future's result is
        ``[n, num_labels]`` (a list of ``[len, num_labels]`` for a token classifier:
        ``per_token``). An input may be a (text, text) pair, read through the tokenizer's pair
        template (NLI models; text-embeddings-inference's ``/predict``): pairs are cut
        longest-first from their texts' ends, so ``truncation_side="left"`` is refused for a
        call with a pair in it."""
        return self._scorer.submit_classify(
            texts, use_activation=use_activation, truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side, long_inputs=long_inputs, per_token=per_token,
        )  # fmt: skip

    # -- lifecycle ------------------------------------------------------------------------------

    @overload
    def int8_bound(self, dimensions: int | None = None, *, wait: Literal[True] = True) -> float: ...

    @overload
    def int8_bound(self, dimensions: int | None = None, *, wait: bool) -> float | None: ...

    def int8_bound(self, dimensions: int | None = None, *, wait: bool = True) -> float | None:
        """The bound ``c`` of ``embed(..., dimensions=dimensions)`` vectors (``int8_scale.py``'s
        rule): their int8 is ``round(127 * v / c)``, so ``v ≈ int8 * c / 127``. Computed on
        first use (blocks while the calibration texts are embedded), then fixed; ``wait=False``
        never blocks: None until computed (an event loop asks so first)."""
        key = ("embed", dimensions)
        if not wait:
            return self._int8.known(key)
        return self._int8.bound(
            key, lambda texts: self.embed(texts, dimensions=dimensions, long_inputs="truncate")
        )

    @property
    def health(self) -> str:
        """ok | degraded (a stage or replica died and is being restarted; calls wait) | dead |
        closed."""
        return self.pipeline.health

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
        if (
            write_trace
            and not self._trace_written
            and self.pipeline.tracing
            and self.health in ("ok", "degraded")
        ):
            try:
                summary = self.write_trace(timeout=60)
                log.info("%s\ntrace written to %s", summary.text(), self.config.trace)
            except Exception as exc:  # the trace must not keep the engine from closing
                log.warning("could not write the trace: %r", exc)
        self._trace_written = True
        self.pipeline.close()
        vision = getattr(self, "_vision", None)  # None too where __init__ failed early
        if vision is not None:
            vision.close()
        vlm = getattr(self, "_vlm", None)
        if vlm is not None:
            vlm.close()
        self.tokenizer.close()

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
