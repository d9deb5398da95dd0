"""``Engine.score``, ``rerank`` and ``classify``: a classifier's head (cross-encoders,
Qwen3-Reranker, sequence classifiers) through the same engine as embeddings.

Each call is ordinary requests whose pooled row the last stage turns into scores (the head
and its activation run there, over the whole step: ``stage/heads.ScoreHead``). Pairs are
tokenized by ``pairs.PairEncoder``; results come back in input order, and rerank sorts them.
sentence-transformers' ``CrossEncoder.predict`` / ``rank`` over the same requests are
``cross_encoder.py``'s. A ColBERT or BGE-M3 model scores pairs from its retrieval outputs
instead (MaxSim; BGE-M3's weighted mix): ``retrieval_scoring.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from ..config import check_long_inputs
from ..core.request import PoolingParams
from ..core.submission import Submission
from ..errors import InvalidInputError
from ..intake.pairs import PairEncoder, encode_chunks
from .pair_options import best_chunk_scores, kept_end, refuse_for_late_interaction
from .predict import submit_predict
from .retrieval_scoring import (
    finished_submission,
    refuse_other_pair_options,
    score_retrieval_pairs,
    scores_pairs_itself,
)

if TYPE_CHECKING:
    from ..core.classifier_head import ClassifierHead
    from ..intake.inputs import InputPreparer
    from ..loading.deployment import Deployment
    from .engine import Engine
    from .engine_info import EngineInfo


@dataclass(frozen=True)
class RerankResult:
    """One document of a ranking: its position in the call's list and its score."""

    index: int
    relevance_score: float
    document: str | None = None  # with return_documents=True


@dataclass(frozen=True)
class Classification:
    """Scores of a classifier for each input, and its label names."""

    probs: np.ndarray  # [n, num_labels] float32: the activation's output (logits if raw)
    label_names: tuple[str, ...]  # id2label, in label order

    @property
    def labels(self) -> list[str]:
        """The label with the highest score, per input."""
        return [self.label_names[i] for i in self.probs.argmax(axis=1).tolist()]


class Scorer:
    """The classifier half of the ``Engine`` (the engine's ``score``, ``rerank``, ``classify``,
    ``classify_tokens`` and their futures are this object's; ``Engine`` states the contract of
    each). Pairs are tokenized by ``PairEncoder``; requests go to the engine's
    ``submit_tokens``. Thread-safe; bad input raises ``InvalidInputError`` naming the
    problem."""

    def __init__(self, engine: Engine, deployment: Deployment, inputs: InputPreparer) -> None:
        self.engine = engine
        self.deployment = deployment
        self.inputs = inputs
        self.config = engine.config

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
        """``Engine.score``."""
        queries, documents = pair_up(text_1, text_2)
        submission = self.submit_pairs(
            queries,
            documents,
            use_activation=use_activation,
            instruction=instruction,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
            long_inputs=long_inputs,
            weights=weights,
        )
        return submission.result()[:, 0]

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
        """``Engine.rerank``."""
        check_top_n(top_n)
        if not isinstance(query, str):
            raise InvalidInputError("query must be a string", param="query")
        queries, docs = pair_up([query], documents, name_1="query", name_2="documents")
        options: dict[str, Any] = dict(
            use_activation=use_activation,
            instruction=instruction,
            max_tokens_per_doc=max_tokens_per_doc,
            truncate_prompt_tokens=truncate_prompt_tokens,
            long_inputs=long_inputs,
            weights=weights,
        )
        if max_chunks_per_doc is not None:
            submission, owners = self.submit_chunked_pairs(
                queries, docs, max_chunks_per_doc=max_chunks_per_doc, **options
            )
            scores = best_chunk_scores(submission.result()[:, 0], owners)
        else:
            submission = self.submit_pairs(
                queries, docs, truncation_side=truncation_side, **options
            )
            scores = submission.result()[:, 0]
        return [
            RerankResult(i, float(scores[i]), docs[i] if return_documents else None)
            for i in ranking(scores, top_n).tolist()
        ]

    def classify(
        self,
        texts: str | Sequence[str],
        *,
        use_activation: bool = True,
        truncate_prompt_tokens: int | None = None,
        truncation_side: str = "right",
        long_inputs: str | None = None,
    ) -> Classification:
        """``Engine.classify``."""
        submission = self.submit_classify(
            texts,
            use_activation=use_activation,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
            long_inputs=long_inputs,
        )
        return Classification(submission.result(), self._head.labels)

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
        """``Engine.submit_pairs``."""
        refuse_other_pair_options(self.deployment, weights=weights, instruction=instruction)
        if self.deployment.classifier is None and scores_pairs_itself(self.deployment):
            refuse_for_late_interaction(
                self.deployment,
                truncation_side=truncation_side != "right",
                max_tokens_per_query=max_tokens_per_query is not None,
            )
            scores = score_retrieval_pairs(
                self.engine,
                self.deployment.retrieval,
                queries,
                documents,
                use_activation=use_activation,
                max_tokens_per_doc=max_tokens_per_doc,
                truncate_prompt_tokens=truncate_prompt_tokens,
                long_inputs=long_inputs,
                weights=weights,
            )
            return finished_submission(scores)
        need_classifier(self.engine.info, "scoring pairs", one_label=not per_label)
        limit = self._limit(truncate_prompt_tokens, long_inputs)
        part = self._pair_encoder.encode(
            queries,
            documents,
            limit=limit,
            instruction=instruction,
            max_tokens_per_doc=max_tokens_per_doc,
            max_tokens_per_query=max_tokens_per_query,
            keep=kept_end(truncation_side),
        )
        params = self._score_params(use_activation)
        return self.engine.submit_tokens(part.token_ids, part.lengths, params, part.type_ids)

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
        """``Engine.submit_chunked_pairs``."""
        refuse_other_pair_options(self.deployment, weights=weights, instruction=instruction)
        if self.deployment.classifier is None and scores_pairs_itself(self.deployment):
            refuse_for_late_interaction(self.deployment, max_chunks_per_doc=True)
        need_classifier(self.engine.info, "scoring pairs", one_label=True)
        self._policy(long_inputs)  # a bad long_inputs is refused here too
        window = self.inputs._limit(truncate_prompt_tokens) or self.deployment.max_model_len
        part, owners = encode_chunks(
            self._pair_encoder,
            queries,
            documents,
            window=window,
            max_chunks=max_chunks_per_doc,
            max_tokens_per_doc=max_tokens_per_doc,
            max_tokens_per_query=max_tokens_per_query,
        )
        params = self._score_params(use_activation)
        return self.engine.submit_tokens(
            part.token_ids, part.lengths, params, part.type_ids
        ), owners

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
        """``Engine.submit_classify``."""
        need_classifier(
            self.engine.info, "token classification" if per_token else "classification",
            per_token=per_token,
        )  # fmt: skip
        if not isinstance(texts, str) and any(_is_text_pair(t) for t in texts):
            if per_token:
                raise InvalidInputError("a token classifier classifies texts", param="input")
            return submit_predict(
                self, texts, use_activation=use_activation,
                truncate_prompt_tokens=truncate_prompt_tokens,
                truncation_side=truncation_side, long_inputs=long_inputs,
            )  # fmt: skip
        policy = self._policy(long_inputs)
        parts = list(
            self.inputs.token_slices(
                texts,
                truncate_prompt_tokens=truncate_prompt_tokens,
                truncation_side=truncation_side,
                long_inputs=policy,
            )
        )
        token_ids = np.concatenate([p.token_ids for p in parts])
        lengths = np.concatenate([p.lengths for p in parts])
        return self.engine.submit_tokens(token_ids, lengths, self._score_params(use_activation))

    def classify_tokens(
        self,
        texts: str | Sequence[str],
        *,
        aggregation_strategy: str = "simple",
        truncate_prompt_tokens: int | None = None,
        long_inputs: str | None = None,
    ) -> list[list[dict]]:
        """``Engine.classify_tokens``."""
        from .token_classification import TokenAggregator, check_strategy

        check_strategy(aggregation_strategy)  # before the engine computes anything

        items = [texts] if isinstance(texts, str) else list(texts)
        if not all(isinstance(t, str) for t in items):
            raise InvalidInputError("classify_tokens takes texts", param="input")
        submission = self.submit_classify(
            items, truncate_prompt_tokens=truncate_prompt_tokens, long_inputs=long_inputs,
            per_token=True,
        )  # fmt: skip
        probs = submission.result()  # [len, labels] per text
        aggregator = TokenAggregator(self.inputs.tokenizer.backend, self._head.labels)
        return [
            aggregator.entities(text, p, aggregation_strategy)
            for text, p in zip(items, probs, strict=True)
        ]

    # -- helpers --------------------------------------------------------------------------------

    @property
    def _head(self) -> ClassifierHead:
        """The classifier's head, for calls ``need_classifier`` let through."""
        head = self.deployment.classifier
        assert head is not None, "need_classifier refuses embedding models first"
        return head

    @cached_property
    def _pair_encoder(self) -> PairEncoder:
        return PairEncoder(self.deployment, self.inputs)

    def _score_params(self, use_activation: bool) -> PoolingParams:
        if not isinstance(use_activation, bool):
            raise InvalidInputError("use_activation must be true or false", param="use_activation")
        return PoolingParams(pooling=self.deployment.pooling, normalize=use_activation)

    def _policy(self, long_inputs: str | None) -> str:
        """Over-long inputs are truncated or refused; chunked windows have no meaning for a
        score, so an engine that chunks embeddings truncates what it scores."""
        if long_inputs == "chunk":
            raise InvalidInputError(
                "long_inputs='chunk' combines windows of an embedding; a score is computed on "
                "the whole input: use 'truncate' or 'error'",
                param="long_inputs",
            )
        policy = check_long_inputs(long_inputs or self.config.long_inputs)
        return "truncate" if policy == "chunk" else policy

    def _limit(self, truncate_prompt_tokens: int | None, long_inputs: str | None) -> int | None:
        policy = self._policy(long_inputs)
        limit = self.inputs._limit(truncate_prompt_tokens)
        if limit is None and policy == "truncate":
            limit = self.deployment.max_model_len
        return limit


def refuse_embedding(info: EngineInfo, pooling: str | None = None) -> None:
    """A classifier's hidden states are not embeddings it was trained to give, nor are a
    sparse or multi-vector model's (``pooling`` None: its default dense vector; BGE-M3's token
    rows are packed heads, not token embeddings): say what it does instead."""
    outputs = info.outputs
    if "dense" not in outputs or (pooling == "all" and len(outputs) > 1):
        raise InvalidInputError(
            f"this model gives {', '.join(outputs)} outputs, not "
            f"{'token embeddings' if pooling == 'all' else 'dense embeddings'}: use "
            "embed_sparse, embed_multi_vector or encode_outputs (the server's /embed_sparse, "
            'or "outputs" on /v1/embeddings)',
            param="outputs",
        )
    head = info.classifier
    if head is not None:
        raise InvalidInputError(
            f"this model ({info.architecture}) is a classifier with "
            f"{head.num_labels} label(s), not an embedding model: use score, rerank or classify "
            "(/score, /rerank, /classify)",
            param="model",
        )


def need_classifier(
    info: EngineInfo, task: str, *, one_label: bool = False, per_token: bool = False
) -> None:
    """Refuses a call a model's classifier head cannot do, saying what the model does."""
    head = info.classifier
    if head is None:
        raise InvalidInputError(
            f"this model ({info.architecture}) is an embedding model and cannot "
            f"do {task}: that needs a cross-encoder or reranker (a *ForSequenceClassification "
            "checkpoint, or Qwen3-Reranker), or a ColBERT or BGE-M3 model (late interaction)",
            param="model",
        )
    if head is not None and head.per_token != per_token:
        raise InvalidInputError(
            f"this model ({info.architecture}) is "
            + ("a token classifier: use classify_tokens" if head.per_token
               else "not a token classifier (a *ForTokenClassification checkpoint)")
            + f", not {task}",
            param="model",
        )  # fmt: skip
    if one_label and not head.can_rerank:
        raise InvalidInputError(
            f"this classifier has {head.num_labels} labels; {task} needs one score per pair "
            "(a model with one label): use classify",
            param="model",
        )


def pair_up(
    text_1: str | Sequence[str],
    text_2: str | Sequence[str],
    *,
    name_1: str = "text_1",
    name_2: str = "text_2",
) -> tuple[list[str], list[str]]:
    """vLLM's score inputs as pairs: one first text against every second one, or pairwise."""
    firsts = _texts(text_1, name_1)
    seconds = _texts(text_2, name_2)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise InvalidInputError(
            f"{name_1} has {len(firsts)} texts and {name_2} {len(seconds)}: give one {name_1} "
            f"(scored against every {name_2}) or as many as {name_2}",
            param=name_1,
        )
    return firsts, seconds


def _texts(value: str | Sequence[str], name: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, (Sequence, np.ndarray)) or not all(isinstance(t, str) for t in texts):
        raise InvalidInputError(f"{name} must be a string or a list of strings", param=name)
    if not len(texts):
        raise InvalidInputError(f"{name} is empty: give at least one text", param=name)
    return list(texts)


def check_top_n(top_n: int | None) -> None:
    if top_n is None:
        return
    if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
        raise InvalidInputError(
            f"top_n must be a non-negative integer (0: all documents), got {top_n!r}",
            param="top_n",
        )


def ranking(scores: np.ndarray, top_n: int | None) -> np.ndarray:
    """Indices by descending score, ties in input order (sentence-transformers' ``rank``
    sorts the same way); the first ``top_n`` (None or 0: all)."""
    order = np.argsort(-scores, kind="stable")
    return order[:top_n] if top_n else order


def _is_text_pair(item: object) -> bool:
    """A (text, text) pair of ``submit_classify``'s inputs (a token-id list is not one)."""
    return (
        isinstance(item, (tuple, list))
        and len(item) == 2
        and isinstance(item[0], str)
        and isinstance(item[1], str)
    )
