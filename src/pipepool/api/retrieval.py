"""Sparse and multi-vector outputs of the Engine (``RetrievalEncoder``): SPLADE's vocabulary
weights, BGE-M3's dense + lexical + ColBERT outputs from one forward, PyLate ColBERT's token
vectors, and MaxSim between them.

The last stage computes the heads (``stage/token_heads.py``); here the rows that come back
become each output: a SparseEncoder's vocabulary-sized vector its non-zero (index, value)
pairs; BGE-M3's packed token rows (``retrieval.M3Layout``) its dense vector, lexical weights
(max over a token id's occurrences, special tokens dropped, as FlagEmbedding) and ColBERT
vectors (every token after the first); ColBERT's token vectors the query's all (expansion
included) or a document's less its skiplist tokens, as PyLate returns them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..core.request import PoolingParams
from ..errors import InvalidInputError
from ..intake.inputs import TokenSlice
from ..loading.retrieval import (
    OUTPUTS,
    ColbertHead,
    M3Head,
    M3Layout,
    SpladeHead,
    special_token_ids,
)

if TYPE_CHECKING:
    from ..core.submission import Submission
    from ..intake.inputs import InputPreparer
    from ..loading.deployment import Deployment
    from .engine import Engine


@dataclass(frozen=True)
class SparseEmbedding:
    """One text's sparse vector: token ids (ascending) and their weights (all > 0), and the
    tokens' strings where asked for."""

    indices: np.ndarray  # [k] int64
    values: np.ndarray  # [k] float32
    tokens: list[str] | None = None

    def to_dict(self) -> dict[int, float]:
        return dict(zip(self.indices.tolist(), self.values.tolist(), strict=True))


@dataclass(frozen=True)
class RetrievalOutputs:
    """The outputs one call asked for, in input order; None where not asked for."""

    dense: np.ndarray | None = None  # [n, dim] float32
    sparse: list[SparseEmbedding] | None = None
    multi_vector: list[np.ndarray] | None = None  # [tokens, dim] float32 each
    num_tokens: list[int] = field(default_factory=list)  # prompt length of each input


class RetrievalEncoder:
    """The engine's ``encode_outputs`` for sparse and multi-vector models (``Deployment.outputs``
    says which outputs a model gives; asking for another is an ``InvalidInputError`` naming
    them); requests go to the engine's ``submit_tokens``."""

    def __init__(self, engine: Engine, deployment: Deployment, inputs: InputPreparer) -> None:
        self.engine = engine
        self.deployment = deployment
        self.inputs = inputs

    def _enqueue(self, params: PoolingParams, part: TokenSlice) -> Submission:
        return self.engine.submit_tokens(part.token_ids, part.lengths, params, None, part.key_lens)

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
        """Any subset of the model's outputs (dense, sparse, multi_vector) from one forward
        pass per input."""
        d = self.deployment
        wanted = check_outputs(d.outputs, outputs)
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                                  or top_k < 1):  # fmt: skip
            raise InvalidInputError("top_k must be a positive integer", param="top_k")
        if long_inputs == "chunk":
            raise InvalidInputError(
                "long_inputs='chunk' combines dense vectors only; sparse and multi-vector "
                "outputs take truncate or error",
                param="long_inputs",
            )
        head = d.retrieval
        if not self.inputs.items(inputs):
            return _empty(wanted, d)  # as ``embed`` answers no input
        options = {
            "truncate_prompt_tokens": truncate_prompt_tokens,
            "truncation_side": truncation_side,
            "prompt_name": prompt_name,
            "long_inputs": long_inputs or "truncate",
        }
        if isinstance(head, ColbertHead):
            prompts, keys = self._colbert_prompts(head, inputs, is_query, options)
        else:
            prompts, keys = self.inputs.prepare(inputs, **options), None
        lengths = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=len(prompts))
        part = TokenSlice(0, np.concatenate(prompts), lengths, None, keys)
        num_tokens = lengths.tolist()
        if isinstance(head, SpladeHead):
            params = PoolingParams(d.pooling, normalize=bool(normalize))
            rows = self._enqueue(params, part).result()
            sparse = [self._sparse(r, top_k, return_tokens) for r in rows]
            return RetrievalOutputs(sparse=sparse, num_tokens=num_tokens)
        if isinstance(head, M3Head) and wanted != ("dense",):
            norm = True if normalize is None else bool(normalize)
            tokens = self._enqueue(PoolingParams("all", normalize=norm), part).result()
            return self._m3(head, wanted, prompts, tokens, top_k, return_tokens, num_tokens)
        if isinstance(head, ColbertHead):
            norm = head.normalize if normalize is None else bool(normalize)
            tokens = self._enqueue(PoolingParams("all", normalize=norm), part).result()
            skip = head.skip_in_queries or not is_query
            vectors = [
                t[~np.isin(p, head.skiplist_ids)] if skip else t
                for t, p in zip(tokens, prompts, strict=True)
            ]
            return RetrievalOutputs(multi_vector=vectors, num_tokens=num_tokens)
        params = self.inputs.params(d.pooling, None, normalize)
        dense = self._enqueue(params, part).result()
        return RetrievalOutputs(dense=dense, num_tokens=num_tokens)

    # -- per model kind ---------------------------------------------------------------------

    def _sparse(self, row: np.ndarray, top_k: int | None, return_tokens: bool) -> SparseEmbedding:
        indices = np.flatnonzero(row > 0)
        indices, values = _top(indices.astype(np.int64), row[indices].astype(np.float32), top_k)
        return self._sparse_of(indices, values, return_tokens)

    def _sparse_of(
        self, indices: np.ndarray, values: np.ndarray, return_tokens: bool
    ) -> SparseEmbedding:
        tokens = None
        if return_tokens:
            backend = self.inputs.tokenizer.backend
            tokens = [backend.id_to_token(int(i)) or "" for i in indices.tolist()]
        return SparseEmbedding(indices, values, tokens)

    def _m3(
        self,
        head: M3Head,
        wanted: tuple[str, ...],
        prompts: list[np.ndarray],
        rows: list[np.ndarray],
        top_k: int | None,
        return_tokens: bool,
        num_tokens: list[int],
    ) -> RetrievalOutputs:
        layout = M3Layout(self.deployment.hidden_size, head.colbert_dim)
        dense = sparse = multi = None
        if "dense" in wanted:
            dense = np.stack([r[0, : layout.hidden] for r in rows]) if rows else None
        if "sparse" in wanted:
            special = self.__dict__.get("_m3_special")
            if special is None:  # read once per engine
                special = np.array(m3_special_ids(self.deployment), dtype=np.int64)
                self.__dict__["_m3_special"] = special
            weights = [r[:, layout.width] for r in rows]
            sparse = [
                self._sparse_of(*_top(ids, w, top_k), return_tokens)
                for ids, w in lexical_weights_of(prompts, weights, special)
            ]
        if "multi_vector" in wanted:
            multi = [r[1:, : head.colbert_dim] for r in rows]  # views: no copy of the rows
        return RetrievalOutputs(dense, sparse, multi, num_tokens)

    def _colbert_prompts(
        self, head: ColbertHead, inputs, is_query: bool, options: dict
    ) -> tuple[list[np.ndarray], np.ndarray | None]:
        """PyLate's prompts: the prefix token after the first, cut to the query or document
        length; queries padded with [MASK] to the expansion length (expansion tokens, which are
        not attended to unless the model says so). A MultiVectorEncoder's: its text prompt
        before the text (where the caller names none), then the same cut and padding."""
        prefix = head.query_prefix_id if is_query else head.document_prefix_id
        limit = head.query_length if is_query else head.document_length
        room = limit - 1 if prefix is not None and limit is not None else limit
        asked = options.pop("truncate_prompt_tokens")
        options["truncate_prompt_tokens"] = (
            room if asked is None else asked if room is None else min(asked, room)
        )
        if options.get("prompt_name") is None:
            options["prompt_name"] = (
                head.query_prompt_name if is_query else head.document_prompt_name
            )
        prompts = self.inputs.prepare(inputs, **options)
        if prefix is not None:
            prompts = [np.concatenate([p[:1], [prefix], p[1:]]).astype(np.int64) for p in prompts]
        keys = None
        if is_query and head.do_query_expansion:
            keys = np.array([len(p) for p in prompts], dtype=np.int64)
            width = head.expansion_length
            prompts = [
                np.concatenate([p, np.full(max(width - len(p), 0), head.mask_id, np.int64)])
                for p in prompts
            ]
            if head.attend_to_expansion_tokens:
                keys = None
        return prompts, keys


def check_outputs(given: Sequence[str], outputs: Sequence[str]) -> tuple[str, ...]:
    """The outputs asked for, each one the model gives (``given``: ``EngineInfo.outputs``),
    in OUTPUTS order."""
    if isinstance(outputs, str):
        outputs = [outputs]
    unknown = [o for o in outputs if o not in OUTPUTS]
    if unknown or not outputs:
        raise InvalidInputError(
            f"outputs must be a non-empty list of {', '.join(OUTPUTS)}; got {list(outputs)!r}",
            param="outputs",
        )
    missing = [o for o in outputs if o not in given]
    if missing:
        raise InvalidInputError(
            f"this model does not give {', '.join(missing)} outputs; it gives {', '.join(given)}",
            param="outputs",
        )
    return tuple(o for o in OUTPUTS if o in outputs)


def lexical_weights_of(
    prompts: list[np.ndarray], weights: list[np.ndarray], special: np.ndarray
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(token ids ascending, weights) of each prompt: each id's largest weight over its
    occurrences, where above zero, special tokens left out (FlagEmbedding's lexical weights).
    One sort for the whole call: a call of thousands of short texts spends no Python loop
    per token, nor numpy calls per text beyond the final split."""
    n = len(prompts)
    lengths = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=n)
    ids = np.concatenate(prompts) if n else np.empty(0, np.int64)
    w = np.concatenate(weights).astype(np.float32) if n else np.empty(0, np.float32)
    text = np.repeat(np.arange(n, dtype=np.int64), lengths)
    keep = (w > 0) & ~np.isin(ids, special)
    ids, w, text = ids[keep], w[keep], text[keep]
    order = np.lexsort((ids, text))  # by text, then id
    ids, w, text = ids[order], w[order], text[order]
    starts = np.flatnonzero(np.r_[True, (ids[1:] != ids[:-1]) | (text[1:] != text[:-1])])
    best = np.maximum.reduceat(w, starts) if len(w) else w
    ids, text = ids[starts], text[starts]
    bounds = np.searchsorted(text, np.arange(n + 1))
    return [(ids[bounds[i] : bounds[i + 1]], best[bounds[i] : bounds[i + 1]]) for i in range(n)]


def _top(ids: np.ndarray, values: np.ndarray, k: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` largest values (ties: the lower id), still in id order; all where k is None."""
    if k is None or len(ids) <= k:
        return ids, values
    keep = np.sort(np.argsort(-values, kind="stable")[:k])
    return ids[keep], values[keep]


def m3_special_ids(deployment: Deployment) -> tuple[int, ...]:
    """Ids of the tokenizer's cls, eos, pad and unk tokens, whose lexical weights BGE-M3
    drops (its tokenizer's ``special_tokens_map``)."""
    roles = ("cls_token", "eos_token", "pad_token", "unk_token")
    return special_token_ids(deployment.folder, roles)


def max_sim(query: np.ndarray, document: np.ndarray) -> float:
    """ColBERT's late-interaction score: for each query vector its best dot product with a
    document vector, summed over the query's vectors."""
    if not len(query) or not len(document):
        return 0.0
    return float((query @ document.T).max(axis=1).sum())


def _empty(wanted: tuple[str, ...], d: Deployment) -> RetrievalOutputs:
    return RetrievalOutputs(
        dense=np.empty((0, d.output_dim), np.float32) if "dense" in wanted else None,
        sparse=[] if "sparse" in wanted else None,
        multi_vector=[] if "multi_vector" in wanted else None,
    )
