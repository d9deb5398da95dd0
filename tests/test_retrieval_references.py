"""Issue 33: the tiny sparse and multi-vector folders and their references run, and compute what
tiny_retrieval's docstrings say they compute (so that the engine has a stated target)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tiny_retrieval as tr
import torch
from tiny_models import SENTENCES

# Each reference runs in a subprocess that imports its library (about 10 s of CPU each).
pytestmark = pytest.mark.slow

# Short and long texts, repeated words (max over repeated ids), punctuation (PyLate's skiplist).
TEXTS = [
    SENTENCES[0],
    SENTENCES[1],
    "Hi",
    "What? No!! (maybe) -- the cat, the cat, the cat.",
    " ".join(SENTENCES[:10]),
]


def _unit_rows(x: np.ndarray) -> bool:
    return bool(np.allclose(np.linalg.norm(x, axis=-1), 1.0, atol=1e-5))


# -- SPLADE (sentence-transformers in the venv) ----------------------------------------------


SPLADE_TYPES = {
    "st6": "sentence_transformers.sparse_encoder.modules.mlm_transformer.MLMTransformer",
    "st5": "sentence_transformers.sparse_encoder.models.MLMTransformer",
}


@pytest.mark.parametrize(("pooling", "layout"), [("max", "st6"), ("sum", "st6"), ("max", "st5")])
def test_splade_reference_is_log1p_relu_pooled_mlm_logits(tmp_path, pooling, layout):
    import transformers

    path = tr.build_splade(tmp_path / f"splade-{pooling}", pooling, layout=layout)
    modules = json.loads((path / "modules.json").read_text())
    assert [m["path"] for m in modules] == ["", "1_SpladePooling"]
    assert modules[0]["type"] == SPLADE_TYPES[layout]
    pooling_config = json.loads((path / "1_SpladePooling" / "config.json").read_text())
    assert pooling_config["pooling_strategy"] == pooling
    assert pooling_config["activation_function"] == "relu"

    sparse = tr.splade_reference(path, TEXTS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    mlm = transformers.AutoModelForMaskedLM.from_pretrained(str(path), dtype=torch.float32)
    for text, (ids, values) in zip(TEXTS, sparse, strict=True):
        assert len(ids) and (values > 0).all() and (np.diff(ids) > 0).all()
        assert len(ids) < 2000, "the tiny SPLADE should be sparse"
        with torch.no_grad():  # every position, [CLS] and [SEP] included
            logits = mlm(**tokenizer(text, return_tensors="pt")).logits[0]
        per_token = torch.log1p(torch.relu(logits))
        pooled = (per_token.max(0).values if pooling == "max" else per_token.sum(0)).numpy()
        assert set(np.flatnonzero(pooled)) == set(ids.tolist())
        np.testing.assert_allclose(values, pooled[ids], rtol=1e-4, atol=1e-5)


# -- BGE-M3 (FlagEmbedding in a subprocess) --------------------------------------------------

PAIRS = [(TEXTS[0], TEXTS[1]), (TEXTS[0], TEXTS[4]), (TEXTS[3], TEXTS[4]), (TEXTS[2], TEXTS[0])]
WEIGHTS = [0.4, 0.2, 0.4]
MAX_LENGTH, MAX_QUERY, MAX_PASSAGE = 48, 16, 40


@pytest.fixture(scope="module")
def bge_m3(tmp_path_factory):
    path = tr.build_bge_m3(tmp_path_factory.mktemp("retrieval") / "bge-m3")
    inputs = {
        "texts": TEXTS,
        "max_length": MAX_LENGTH,
        "pairs": PAIRS,
        "weights": WEIGHTS,
        "max_query_length": MAX_QUERY,
        "max_passage_length": MAX_PASSAGE,
    }
    return path, tr.run_reference("bge_m3", path, inputs)


def test_bge_m3_encode_matches_its_definition(bge_m3):
    path, ref = bge_m3
    assert ref["config"]["unused_token_ids"] == [0, 1, 2, 3]  # <s> <pad> </s> <unk>
    lengths = [len(ids) for ids in ref["input_ids"]]
    assert max(lengths) == MAX_LENGTH, "the long text should be truncated"
    assert ref["dense"].shape == (len(TEXTS), 64) and _unit_rows(ref["dense"])
    for ids, colbert, lexical in zip(
        ref["input_ids"], ref["colbert"], ref["lexical_weights"], strict=True
    ):
        assert ids[0] == 0 and ids[-1] == 2
        assert colbert.shape == (len(ids) - 1, 64) and _unit_rows(colbert)
        assert all(w > 0 for w in lexical.values())
        assert set(lexical) <= set(ids.tolist()) - {0, 1, 2, 3}

    by_hand = tr.bge_m3_by_hand(path, TEXTS, MAX_LENGTH)
    np.testing.assert_allclose(ref["dense"], by_hand["dense"], atol=1e-5)
    for i in range(len(TEXTS)):
        np.testing.assert_allclose(ref["colbert"][i], by_hand["colbert"][i], atol=1e-5)
        assert ref["lexical_weights"][i].keys() == by_hand["lexical_weights"][i].keys()
        for token, w in ref["lexical_weights"][i].items():
            assert abs(w - by_hand["lexical_weights"][i][token]) < 1e-5


def test_bge_m3_compute_score_matches_its_formulas(bge_m3):
    path, ref = bge_m3
    queries = tr.bge_m3_by_hand(path, [q for q, _ in PAIRS], MAX_QUERY)
    passages = tr.bge_m3_by_hand(path, [p for _, p in PAIRS], MAX_PASSAGE)
    dense, sparse, colbert = [], [], []
    for i in range(len(PAIRS)):
        dense.append(float(queries["dense"][i] @ passages["dense"][i]))
        q_lex, p_lex = queries["lexical_weights"][i], passages["lexical_weights"][i]
        sparse.append(sum(w * p_lex[t] for t, w in q_lex.items() if t in p_lex))
        sims = queries["colbert"][i] @ passages["colbert"][i].T  # [q_len - 1, p_len - 1]
        colbert.append(float(sims.max(1).mean()))
    dense, sparse, colbert = np.array(dense), np.array(sparse), np.array(colbert)
    w_dense, w_sparse, w_colbert = WEIGHTS
    expected = {
        "dense": dense,
        "sparse": sparse,
        "colbert": colbert,
        "sparse+dense": (w_sparse * sparse + w_dense * dense) / (w_sparse + w_dense),
        "colbert+sparse+dense": (w_colbert * colbert + w_sparse * sparse + w_dense * dense)
        / sum(WEIGHTS),
    }
    assert (sparse > 0).any(), "no pair shares a weighted token: the sparse score is untested"
    for mode, values in expected.items():
        np.testing.assert_allclose(ref["score1"][mode], values, atol=1e-5, err_msg=mode)
        # Batched, shorter passages are padded with zero vectors: the colbert max is then
        # max(best similarity, 0), never below the unpadded score.
        assert (ref["score"][mode] >= ref["score1"][mode] - 1e-5).all(), mode


def test_bge_m3_folder_loads_as_sentence_transformer(bge_m3):
    from sentence_transformers import SentenceTransformer

    path, ref = bge_m3
    model = SentenceTransformer(str(path), device="cpu")
    model.max_seq_length = MAX_LENGTH
    np.testing.assert_allclose(model.encode(TEXTS), ref["dense"], atol=1e-5)


# -- PyLate ColBERT (PyLate in a subprocess) -------------------------------------------------

QUERIES = TEXTS[:4]
RERANK = {"query": 0, "documents": [0, 1, 2, 3, 4]}


@pytest.fixture(scope="module")
def pylate(tmp_path_factory):
    path = tr.build_pylate(tmp_path_factory.mktemp("retrieval") / "colbert")
    pairs = [[q, d] for q in range(len(QUERIES)) for d in range(len(TEXTS))]
    inputs = {"queries": QUERIES, "documents": TEXTS, "pairs": pairs, "rerank": RERANK}
    return path, pairs, tr.run_reference("pylate", path, inputs)


def test_pylate_token_embeddings_follow_colbert_tokenization(pylate):
    _, _, ref = pylate
    config = ref["config"]
    q_prefix, d_prefix, mask = config["query_prefix_id"], config["document_prefix_id"], 103
    assert (q_prefix, d_prefix, config["pad_token_id"]) == (30522, 30523, mask)
    skiplist = set(config["skiplist"])
    assert len(skiplist) == 32  # string.punctuation
    for ids, attention, vecs in zip(ref["query_ids"], ref["query_mask"], ref["query"], strict=True):
        # [CLS] [Q] text... [SEP] then [MASK] up to query_length, unattended; every row kept.
        assert len(ids) == tr.QUERY_LENGTH and ids[0] == 101 and ids[1] == q_prefix
        n = int(attention.sum())
        assert attention[:n].all() and ids[n - 1] == 102 and (ids[n:] == mask).all()
        assert vecs.shape == (tr.QUERY_LENGTH, tr.COLBERT_DIM) and _unit_rows(vecs)
    assert ref["query_mask"][2].sum() < tr.QUERY_LENGTH, "a short query should be expanded"
    for ids, vecs in zip(ref["document_ids"], ref["document"], strict=True):
        # [CLS] [D] text... [SEP], at most document_length; skiplist rows dropped.
        assert ids[0] == 101 and ids[1] == d_prefix and ids[-1] == 102
        assert len(ids) <= tr.DOCUMENT_LENGTH
        kept = sum(int(t) not in skiplist for t in ids)
        assert vecs.shape == (kept, tr.COLBERT_DIM) and _unit_rows(vecs)
    assert len(ref["document_ids"][4]) == tr.DOCUMENT_LENGTH, "the long text should be truncated"
    assert len(ref["document_ids"][3]) > len(ref["document"][3]), "punctuation should be skipped"


def test_pylate_scores_are_sums_of_maxsim(pylate):
    _, pairs, ref = pylate
    for (q, d), score in zip(pairs, ref["pair_scores"], strict=True):
        sims = ref["query"][q] @ ref["document"][d].T
        assert abs(score - sims.max(1).sum()) < 1e-4
    # rerank pads the documents with zero vectors and takes no mask, so a document's score is
    # the pair score only while every query token's best similarity is positive (true here).
    q = RERANK["query"]
    best = [(ref["query"][q] @ ref["document"][d].T).max(1).min() for d in RERANK["documents"]]
    assert min(best) > 0
    by_pair = {d: s for (qi, d), s in zip(pairs, ref["pair_scores"], strict=True) if qi == q}
    expected = sorted(RERANK["documents"], key=lambda d: -by_pair[d])
    assert ref["rerank_ids"].tolist() == expected
    np.testing.assert_allclose(ref["rerank_scores"], [by_pair[d] for d in expected], atol=1e-4)


def test_sentence_transformers_multi_vector_encoder_matches_pylate(pylate):
    """sentence-transformers 6 loads PyLate folders too: an in-venv second opinion."""
    from sentence_transformers.multi_vector_encoder import MultiVectorEncoder

    path, _, ref = pylate
    model = MultiVectorEncoder(str(path), device="cpu")
    queries = model.encode_query(QUERIES, convert_to_numpy=True)
    documents = model.encode_document(TEXTS, convert_to_numpy=True)
    pairs = [
        *zip(queries, ref["query"], strict=True),
        *zip(documents, ref["document"], strict=True),
    ]
    for ours, theirs in pairs:
        assert np.asarray(ours).shape == theirs.shape
        np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-5)
