"""``Retriever``: the sparse and multi-vector calls of retrieval models as an adapter over an
``Engine``'s ``encode_outputs``: ``embed_sparse`` (SPLADE; BGE-M3's lexical weights),
``embed_multi_vector`` (ColBERT; BGE-M3's ColBERT vectors) and ``compute_score_m3`` (BGE-M3's
``compute_score``, as FlagEmbedding's ``BGEM3FlagModel``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .engine_adapter import EngineAdapter
from .retrieval import SparseEmbedding
from .retrieval_scoring import M3_WEIGHTS, m3_scores, split_pairs


class Retriever(EngineAdapter):
    """Sparse and multi-vector outputs of an ``Engine``'s model (``engine.info.outputs`` says
    which it gives; asking for another is an ``InvalidInputError`` naming them).
    ``Retriever(model, **options)`` starts and owns an Engine (``options``: ``EngineConfig``
    fields), closed by ``close()`` or a ``with`` block; ``Retriever(engine)`` shares one, which
    ``close()`` leaves running. Thread-safe."""

    _called = "Retriever"

    def embed_sparse(
        self,
        inputs: str | Sequence[str] | Sequence[Sequence[int]],
        *,
        top_k: int | None = None,
        return_tokens: bool = False,
        **options: Any,
    ) -> list[SparseEmbedding]:
        """One sparse vector per input (SPLADE; BGE-M3's lexical weights). ``top_k``: keep the
        k largest weights (sentence-transformers' ``max_active_dims``); ``return_tokens``: the
        tokens' strings too. ``options``: truncate_prompt_tokens, truncation_side,
        prompt_name, long_inputs, normalize, as for ``Engine.encode_outputs``."""
        out = self.engine.encode_outputs(
            inputs, ("sparse",), top_k=top_k, return_tokens=return_tokens, **options
        )
        assert out.sparse is not None
        return out.sparse

    def embed_multi_vector(
        self,
        inputs: str | Sequence[str] | Sequence[Sequence[int]],
        *,
        is_query: bool = False,
        **options: Any,
    ) -> list[np.ndarray]:
        """One ``[tokens, dim]`` array of unit vectors per input (ColBERT; BGE-M3's ColBERT
        vectors). ``is_query``: PyLate's query form (query prefix, [MASK] expansion) rather
        than the document form. ``options`` as for ``embed_sparse``."""
        out = self.engine.encode_outputs(inputs, ("multi_vector",), is_query=is_query, **options)
        assert out.multi_vector is not None
        return out.multi_vector

    def compute_score_m3(
        self,
        pairs: Sequence[Sequence[str]],
        *,
        weights: Sequence[float] = M3_WEIGHTS,
        max_query_length: int | None = None,
        max_passage_length: int | None = None,
    ) -> dict[str, np.ndarray]:
        """BGE-M3's scores of (query, passage) pairs, as FlagEmbedding's
        ``BGEM3FlagModel.compute_score``: {"colbert", "sparse", "dense", "sparse+dense",
        "colbert+sparse+dense"} -> ``[n]`` float64, in pair order. ``weights`` are [dense,
        sparse, colbert] (the mixes divide by their weights' sum; FlagEmbedding's own default,
        when it is given none, is [1, 1, 1]); queries and passages are cut to
        ``max_query_length`` / ``max_passage_length`` tokens (None: FlagEmbedding's 512; -1:
        max_model_len). One pair may be given as a tuple."""
        scores, _ = m3_scores(
            self.engine,
            *split_pairs(pairs),
            weights=weights,
            max_query_length=max_query_length,
            max_passage_length=max_passage_length,
        )
        return scores
