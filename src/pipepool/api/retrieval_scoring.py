"""Pair scores of retrieval models, for ``Engine.score`` / ``rerank`` (``scoring.Scorer``) and
``Retriever.compute_score_m3``:

- a ColBERT model (PyLate): MaxSim, PyLate's ``scores.colbert_scores``: for every query vector
  (the query form: prefix and [MASK] expansion) its largest dot product with a document
  vector, summed over the query's vectors; no division.
- BGE-M3: FlagEmbedding's ``BGEM3FlagModel.compute_score``: queries cut to
  ``max_query_length`` tokens and passages to ``max_passage_length`` (512 each by default, as
  FlagEmbedding's), then per pair the dense dot product, the lexical match (the sum over
  shared token ids of the two weights' product), the ColBERT score (MaxSim divided by the
  query's vectors, i.e. the mean over them) and the weighted mixes, each divided by the sum of
  its weights. Rerank ranks by the "colbert+sparse+dense" mix.

Every distinct text is encoded once per side (a rerank's query once), one forward per text
(``encode_outputs``); scores are computed here, on the host, from the vectors that come back.
Pairs are scored unpadded, one pair at a time: FlagEmbedding's and PyLate's batched paths pad
shorter passages with zero vectors, whose dot product 0 can exceed a query vector's best
(negative) similarity; their one-pair-per-batch scores are the definition we follow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.request import PoolingParams
from ..core.submission import Submission
from ..errors import InvalidInputError
from ..loading.retrieval import ColbertHead, M3Head, RetrievalHead
from .retrieval import RetrievalOutputs, SparseEmbedding, max_sim

if TYPE_CHECKING:
    from ..loading.deployment import Deployment
    from .engine import Engine


# [dense, sparse, colbert]: the mix FlagEmbedding's README recommends for BGE-M3 (its
# compute_score weighs the three equally when given no weights).
M3_WEIGHTS = (0.4, 0.2, 0.4)
# FlagEmbedding's query_max_length and passage_max_length defaults.
M3_MAX_LENGTH = 512
M3_MODES = ("colbert", "sparse", "dense", "sparse+dense", "colbert+sparse+dense")


@dataclass(frozen=True)
class PairScores:
    """Scores of a call's pairs, in pair order, and the prompt tokens run for them: each
    distinct text is run once, its tokens counted on the first pair that uses it."""

    scores: np.ndarray  # [n] float32
    num_tokens: np.ndarray  # [n] int64; sum: the tokens the engine ran for the call


def scores_pairs_itself(deployment: Deployment) -> bool:
    """Whether a model without a classifier scores pairs from its retrieval outputs (ColBERT's
    MaxSim, BGE-M3's mix)."""
    return isinstance(deployment.retrieval, (ColbertHead, M3Head))


def pair_options(deployment: Deployment) -> frozenset[str]:
    """The options of a pair-scoring request that apply to this model; every other model
    refuses them: ``weights`` where pairs are scored as BGE-M3's mix of its dense, sparse and
    ColBERT scores (BGE-M3 without a classifier), ``instruction`` where the pair is read
    through Qwen3-Reranker's prompt."""
    head = deployment.classifier
    if head is None:
        return frozenset({"weights"} if isinstance(deployment.retrieval, M3Head) else ())
    return frozenset({"instruction"} if head.template == "qwen3" else ())


_PAIR_OPTION_USES = {
    "weights": "weights mix BGE-M3's dense, sparse and ColBERT scores",
    "instruction": "instruction is Qwen3-Reranker's task instruction",
}


def refuse_other_pair_options(deployment: Deployment, **given: object) -> None:
    """Raise, naming the first, for a pair option given (not None) that this model does not
    take (``pair_options``)."""
    takes = pair_options(deployment)
    for name, value in given.items():
        if value is not None and name not in takes:
            raise InvalidInputError(
                f"{_PAIR_OPTION_USES[name]}; this model scores pairs without it", param=name
            )


def score_retrieval_pairs(
    engine: Engine,
    head: RetrievalHead | None,
    queries: Sequence[str],
    documents: Sequence[str],
    *,
    weights: Sequence[float] | None = None,
    use_activation: bool = True,
    truncate_prompt_tokens: int | None = None,
    max_tokens_per_doc: int | None = None,
    long_inputs: str | None = None,
) -> PairScores:
    """One score per pair ``(queries[i], documents[i])`` of a ColBERT model (MaxSim) or of
    BGE-M3 (the "colbert+sparse+dense" mix, ``weights`` [dense, sparse, colbert], default
    ``M3_WEIGHTS``); blocks until the forwards are done. Neither score has an activation:
    ``use_activation`` is checked and changes nothing. The caller has refused the options this
    model does not take (``refuse_other_pair_options``)."""
    if not isinstance(use_activation, bool):
        raise InvalidInputError("use_activation must be true or false", param="use_activation")
    if isinstance(head, M3Head):
        limit = truncate_prompt_tokens
        passage_limit = _min_limit(limit, max_tokens_per_doc)
        by_mode, num_tokens = m3_scores(
            engine,
            queries,
            documents,
            weights=M3_WEIGHTS if weights is None else weights,
            max_query_length=limit,
            max_passage_length=passage_limit,
            long_inputs=long_inputs,
        )
        return PairScores(by_mode["colbert+sparse+dense"].astype(np.float32), num_tokens)
    assert isinstance(head, ColbertHead), "scores_pairs_itself lets ColBERT and BGE-M3 in"
    q, q_of = _encode_unique(
        engine, queries, ("multi_vector",), is_query=True,
        truncate_prompt_tokens=truncate_prompt_tokens, long_inputs=long_inputs,
    )  # fmt: skip
    d, d_of = _encode_unique(
        engine, documents, ("multi_vector",),
        truncate_prompt_tokens=_min_limit(truncate_prompt_tokens, max_tokens_per_doc),
        long_inputs=long_inputs,
    )  # fmt: skip
    assert q.multi_vector is not None and d.multi_vector is not None
    scores = np.array(
        [max_sim(q.multi_vector[i], d.multi_vector[j]) for i, j in zip(q_of, d_of, strict=True)],
        dtype=np.float32,
    )
    return PairScores(scores, _pair_tokens(q, q_of, d, d_of))


def m3_scores(
    engine: Engine,
    queries: Sequence[str],
    passages: Sequence[str],
    *,
    weights: Sequence[float] = M3_WEIGHTS,
    max_query_length: int | None = None,
    max_passage_length: int | None = None,
    long_inputs: str | None = None,
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """BGE-M3's ``compute_score`` on pairs ``(queries[i], passages[i])``: {mode: [n] float64}
    for every mode of ``M3_MODES``, and the tokens per pair (as ``PairScores.num_tokens``)."""
    w_dense, w_sparse, w_colbert = check_weights(weights)
    wanted = ("dense", "sparse", "multi_vector")
    limit = _m3_limit(engine, max_query_length, "max_query_length")
    q, q_of = _encode_unique(
        engine, queries, wanted, truncate_prompt_tokens=limit, long_inputs=long_inputs
    )
    limit = _m3_limit(engine, max_passage_length, "max_passage_length")
    p, p_of = _encode_unique(
        engine, passages, wanted, truncate_prompt_tokens=limit, long_inputs=long_inputs
    )
    assert q.dense is not None and q.sparse is not None and q.multi_vector is not None
    assert p.dense is not None and p.sparse is not None and p.multi_vector is not None
    pairs = list(zip(q_of, p_of, strict=True))
    dense = np.array([float(q.dense[i] @ p.dense[j]) for i, j in pairs])
    sparse = np.array([sparse_dot(q.sparse[i], p.sparse[j]) for i, j in pairs])
    colbert = np.array([_mean_max_sim(q.multi_vector[i], p.multi_vector[j]) for i, j in pairs])
    # Weights [0, 0, w]: "sparse+dense" is 0 / 0, NaN (as FlagEmbedding's).
    with np.errstate(invalid="ignore", divide="ignore"):
        sparse_dense = (w_sparse * sparse + w_dense * dense) / (w_sparse + w_dense)
    by_mode = {
        "colbert": colbert,
        "sparse": sparse,
        "dense": dense,
        "sparse+dense": sparse_dense,
        "colbert+sparse+dense": (w_colbert * colbert + w_sparse * sparse + w_dense * dense)
        / (w_colbert + w_sparse + w_dense),
    }
    return by_mode, _pair_tokens(q, q_of, p, p_of)


def split_pairs(pairs: Sequence[Sequence[str]]) -> tuple[list[str], list[str]]:
    """(queries, passages) of (query, passage) pairs; one pair may come alone, as
    FlagEmbedding's ``compute_score`` takes it."""
    items: list = list(pairs)
    if len(items) == 2 and all(isinstance(t, str) for t in items):
        items = [items]
    valid = all(
        isinstance(p, (tuple, list)) and len(p) == 2 and all(isinstance(t, str) for t in p)
        for p in items
    )
    if not items or not valid:
        raise InvalidInputError(
            "pairs must be a non-empty list of (query, passage) pairs of texts", param="pairs"
        )
    return [p[0] for p in items], [p[1] for p in items]


def sparse_dot(a: SparseEmbedding, b: SparseEmbedding) -> float:
    """The dot product of two sparse vectors: the sum over their shared token ids of the
    weights' product (FlagEmbedding's lexical matching score)."""
    _, ia, ib = np.intersect1d(a.indices, b.indices, assume_unique=True, return_indices=True)
    return float(a.values[ia].astype(np.float64) @ b.values[ib].astype(np.float64))


def check_weights(weights: Sequence[float]) -> tuple[float, float, float]:
    """[dense, sparse, colbert] weights: three finite numbers, none negative, summing above 0
    (the mix divides by its weights' sum)."""
    values = list(weights) if isinstance(weights, (Sequence, np.ndarray)) else []
    numbers = all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in values)
    if len(values) != 3 or not numbers or not all(math.isfinite(w) and w >= 0 for w in values):
        values = []
    if not sum(values) > 0:
        raise InvalidInputError(
            "weights must be three finite numbers >= 0 that sum above 0: [dense, sparse, "
            f"colbert]; got {weights!r}",
            param="weights",
        )
    return float(values[0]), float(values[1]), float(values[2])


def finished_submission(scores: PairScores) -> Submission:
    """The future of pairs scored already (``[n, 1]`` scores, ``num_tokens`` filled in), for
    the callers of ``submit_pairs``: nothing of it is left in the engine to cancel."""
    n = len(scores.scores)
    # A vector pooling makes the result one [n, 1] array, as a classifier's one-label scores.
    submission = Submission(PoolingParams("cls"), n, 1, on_cancel=lambda _: None)
    submission.num_tokens[:] = scores.num_tokens
    if n:
        submission.put_vectors(np.arange(n), scores.scores[:, None])
    return submission


# -- helpers ------------------------------------------------------------------------------------


def _encode_unique(
    engine: Engine, texts: Sequence[str], outputs: Sequence[str], **options: Any
) -> tuple[RetrievalOutputs, list[int]]:
    """``encode_outputs`` of each distinct text of ``texts`` (in first-seen order) and, per
    text, the index of its row in them."""
    rows: dict[str, int] = {}
    of = [rows.setdefault(t, len(rows)) for t in texts]
    return engine.encode_outputs(list(rows), outputs, **options), of


def _pair_tokens(
    q: RetrievalOutputs, q_of: list[int], d: RetrievalOutputs, d_of: list[int]
) -> np.ndarray:
    """Tokens per pair: each distinct text's on the first pair that has it."""
    tokens = np.zeros(len(q_of), dtype=np.int64)
    for side, of in ((q, q_of), (d, d_of)):
        seen: set[int] = set()
        for pair, row in enumerate(of):
            if row not in seen:
                seen.add(row)
                tokens[pair] += side.num_tokens[row]
    return tokens


def _mean_max_sim(query: np.ndarray, passage: np.ndarray) -> float:
    """FlagEmbedding's ColBERT score: MaxSim divided by the query's vectors."""
    return max_sim(query, passage) / len(query) if len(query) else 0.0


def _m3_limit(engine: Engine, asked: int | None, param: str) -> int:
    """A BGE-M3 side's token limit: ``asked`` (-1: max_model_len), else FlagEmbedding's 512,
    never above max_model_len."""
    longest = engine.info.max_model_len
    if asked is None:
        return min(M3_MAX_LENGTH, longest)
    if isinstance(asked, bool) or not isinstance(asked, int) or (asked < 1 and asked != -1):
        raise InvalidInputError(f"{param} must be a positive integer or -1", param=param)
    return longest if asked == -1 else min(asked, longest)


def _min_limit(limit: int | None, max_tokens_per_doc: int | None) -> int | None:
    """A document's token limit: the call's, cut further by ``max_tokens_per_doc``."""
    if max_tokens_per_doc is None:
        return limit
    if (
        isinstance(max_tokens_per_doc, bool)
        or not isinstance(max_tokens_per_doc, int)
        or max_tokens_per_doc < 1
    ):
        raise InvalidInputError(
            "max_tokens_per_doc must be a positive integer", param="max_tokens_per_doc"
        )
    if limit is None or limit == -1:
        return max_tokens_per_doc
    return min(limit, max_tokens_per_doc)
