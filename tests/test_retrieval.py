"""Sparse and multi-vector outputs against their own libraries, on tiny random-weight folders:
SPLADE against sentence-transformers' SparseEncoder, BGE-M3 against FlagEmbedding's
BGEM3FlagModel, PyLate ColBERT against PyLate (the last two in subprocesses, from their own
target dirs: tests/refs/install.sh). Every engine kind (one process, stage processes,
replicas), a token budget smaller than the longest prompt, fp32 on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import tiny_retrieval

from pipepool import Engine, InvalidInputError, Retriever
from pipepool.api.retrieval import max_sim

BUDGET = 24  # tokens per step: the long texts below take steps of their own

TEXTS = [
    "hello world hello",
    "Sparse retrieval weighs vocabulary terms; dense retrieval compares vectors. " * 3,
    "x",
    "the cat sat on the mat, and the cat slept.",
]
QUERIES = ["what is late interaction?", "a query long enough to be cut at the query length", "x"]
DOCUMENTS = [
    "ColBERT scores documents by MaxSim over token vectors, with punctuation!",
    "short doc.",
    "word " * 80,
    "late interaction: every query token finds its best document token",
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("retrieval")
    return {
        "splade": tiny_retrieval.build_splade(root / "splade"),
        "splade_sum": tiny_retrieval.build_splade(root / "splade-sum", "sum", seed=1),
        "m3": tiny_retrieval.build_bge_m3(root / "m3"),
        "colbert": tiny_retrieval.build_pylate(root / "colbert"),
    }


@pytest.fixture(scope="module")
def references(folders) -> dict:
    texts = TEXTS
    return {
        "splade": tiny_retrieval.splade_reference(folders["splade"], texts),
        "splade_sum": tiny_retrieval.splade_reference(folders["splade_sum"], texts),
        "m3": tiny_retrieval.run_reference("bge_m3", folders["m3"], {"texts": texts,
                                                                     "max_length": 64}),
        "colbert": tiny_retrieval.run_reference(
            "pylate", folders["colbert"], {"queries": QUERIES, "documents": DOCUMENTS,
                                           "pairs": [[0, 0], [0, 3], [1, 2], [2, 1]]},
        ),
    }  # fmt: skip


def _engine(folder, kind: dict, **options) -> Engine:
    return Engine(str(folder), max_num_batched_tokens=BUDGET, **kind, **options)


def _same_sparse(got, ids: np.ndarray, values: np.ndarray) -> None:
    """Same token ids; weights equal within 1e-5 of the vector's largest weight (float32
    rounding of a logit near zero moves a tiny weight by ~1e-7: pointwise relative error
    means nothing there)."""
    np.testing.assert_array_equal(got.indices, ids)
    scale = float(np.abs(values).max()) if len(values) else 1.0
    np.testing.assert_allclose(got.values, values, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("which", ["splade", "splade_sum"])
def test_splade_equals_sparse_encoder(folders, references, engine_kind, which):
    texts = TEXTS
    with _engine(folders[which], engine_kind) as engine:
        assert engine.info.outputs == ("sparse",)
        got = Retriever(engine).embed_sparse(texts, return_tokens=True)
        top = Retriever(engine).embed_sparse(texts, top_k=3)
    for g, (ids, values), t in zip(got, references[which], top, strict=True):
        assert len(ids) > 0
        _same_sparse(g, ids, values)
        tokenizer_ids = [engine.tokenizer.backend.token_to_id(s) for s in g.tokens]
        assert tokenizer_ids == ids.tolist()
        best = np.sort(ids[np.argsort(-values, kind="stable")[:3]])
        np.testing.assert_array_equal(t.indices, best)


def test_bge_m3_equals_flagembedding(folders, references, engine_kind):
    texts = TEXTS
    ref = references["m3"]
    with _engine(folders["m3"], engine_kind, max_model_len=64) as engine:
        assert engine.info.outputs == ("dense", "sparse", "multi_vector")
        out = engine.encode_outputs(texts, ["dense", "sparse", "multi_vector"])
        dense_only = engine.embed(texts)
        sparse_only = Retriever(engine).embed_sparse(texts)
    cos = (out.dense * np.asarray(ref["dense"])).sum(axis=1)
    assert cos.min() >= 0.99999, cos
    assert ((dense_only * out.dense).sum(axis=1) >= 0.99999).all()
    for i in range(len(texts)):
        ids = np.asarray(ref["lexical_ids"][i])
        order = np.argsort(ids)
        values = np.asarray(ref["lexical_values"][i])[order]
        _same_sparse(out.sparse[i], ids[order], values)
        _same_sparse(sparse_only[i], ids[order], values)
        colbert = np.asarray(ref["colbert"][i])
        assert out.multi_vector[i].shape == colbert.shape
        assert (out.multi_vector[i] * colbert).sum(axis=1).min() >= 0.99999


def test_colbert_equals_pylate(folders, references, engine_kind):
    ref = references["colbert"]
    with _engine(folders["colbert"], engine_kind) as engine:
        assert engine.info.outputs == ("multi_vector",)
        queries = Retriever(engine).embed_multi_vector(QUERIES, is_query=True)
        documents = Retriever(engine).embed_multi_vector(DOCUMENTS)
    for side, got in (("query", queries), ("document", documents)):
        for mine, theirs in zip(got, ref[side], strict=True):
            theirs = np.asarray(theirs)
            assert mine.shape == theirs.shape
            assert (mine * theirs).sum(axis=1).min() >= 0.99999
    pairs = [[0, 0], [0, 3], [1, 2], [2, 1]]
    scores = [max_sim(queries[q], documents[d]) for q, d in pairs]
    np.testing.assert_allclose(scores, ref["pair_scores"], rtol=0, atol=1e-4)


def test_outputs_a_model_cannot_give_are_refused(folders):
    with _engine(folders["splade"], {}) as engine:
        with pytest.raises(InvalidInputError, match="gives sparse"):
            engine.embed(["text"])
        with pytest.raises(InvalidInputError, match="does not give multi_vector"):
            Retriever(engine).embed_multi_vector(["text"])
        with pytest.raises(InvalidInputError, match="long_inputs"):
            Retriever(engine).embed_sparse(["text"], long_inputs="chunk")
        with pytest.raises(InvalidInputError, match="top_k"):
            Retriever(engine).embed_sparse(["text"], top_k=0)
    with _engine(folders["m3"], {}) as engine:
        with pytest.raises(InvalidInputError, match="token embeddings"):
            engine.embed_tokens(["text"])
        with pytest.raises(InvalidInputError, match="outputs must be"):
            engine.encode_outputs(["text"], ["bogus"])
    with _engine(folders["colbert"], {}) as engine:
        with pytest.raises(InvalidInputError, match="multi_vector"):
            engine.embed(["text"])
        assert engine.encode_outputs([], ["multi_vector"]).multi_vector == []
