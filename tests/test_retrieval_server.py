"""Issue 33 items 1 and 3 on a real ``pipepool serve``: TEI's ``/embed_sparse`` and
``/v1/embeddings`` with ``outputs`` give what SPLADE's SparseEncoder and FlagEmbedding's
BGEM3FlagModel give; ``/rerank`` and ``/score`` of a ColBERT model are PyLate's MaxSim and rank
as PyLate's ``rerank``; BGE-M3's rerank and ``Retriever.compute_score_m3`` are FlagEmbedding's
``compute_score``. Tiny random-weight folders (``tiny_retrieval``), fp32 on the CPU, a token
budget smaller than the longest prompt."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import tiny_retrieval as tr
from test_server import ServerProcess
from test_server_limits import assert_error

import pipepool

# Slow: real `pipepool serve` processes.
pytestmark = pytest.mark.slow

BUDGET = 32  # tokens per step: the long texts take several steps
TEXTS = [
    "the cat sat on the mat, and the cat slept.",
    "Sparse retrieval weighs vocabulary terms; dense retrieval compares vectors.",
    "x",
    "late interaction: every query token finds its best document token " * 12,
]
QUERY = "where did the cat sleep?"
DOCUMENTS = [
    "the cat slept on the mat.",
    "dogs bark at night",
    "a cat, a mat, and a long afternoon of sleep " * 4,
    "short doc.",
    "the cat slept on the mat.",  # a tie with document 0: input order decides
    "word " * 80,
]
# BGE-M3's scoring: weights [dense, sparse, colbert] all different, so that a mix-up shows; the
# long query and passage are cut at these lengths.
WEIGHTS = [0.5, 0.3, 0.2]
MAX_LENGTH, MAX_QUERY, MAX_PASSAGE = 48, 16, 40
M3_PAIRS = [[QUERY, d] for d in DOCUMENTS] + [[TEXTS[3], TEXTS[0]], [TEXTS[0], TEXTS[3]]]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("retrieval-server")
    return {
        "splade": tr.build_splade(root / "splade"),
        "m3": tr.build_bge_m3(root / "bge-m3"),
        "colbert": tr.build_pylate(root / "colbert"),
    }


def _serve(folder, name: str, tmp_path_factory):
    args = ["--model", str(folder), "--served-model-name", name]
    args += ["--max-num-batched-tokens", str(BUDGET)]
    s = ServerProcess(args, tmp_path_factory.mktemp(f"{name}-log") / "server.log")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def splade_server(folders, tmp_path_factory):
    yield from _serve(folders["splade"], "tiny-splade", tmp_path_factory)


@pytest.fixture(scope="module")
def m3_server(folders, tmp_path_factory):
    yield from _serve(folders["m3"], "tiny-bge-m3", tmp_path_factory)


@pytest.fixture(scope="module")
def colbert_server(folders, tmp_path_factory):
    yield from _serve(folders["colbert"], "tiny-colbert", tmp_path_factory)


@pytest.fixture(scope="module")
def m3_reference(folders) -> dict:
    inputs = {
        "texts": TEXTS,
        "max_length": MAX_LENGTH,
        "pairs": M3_PAIRS,
        "weights": WEIGHTS,
        "max_query_length": MAX_QUERY,
        "max_passage_length": MAX_PASSAGE,
    }
    return tr.run_reference("bge_m3", folders["m3"], inputs)


@pytest.fixture(scope="module")
def colbert_reference(folders) -> dict:
    documents = list(range(len(DOCUMENTS)))
    inputs = {
        "queries": [QUERY],
        "documents": DOCUMENTS,
        "pairs": [[0, d] for d in documents],
        "rerank": {"query": 0, "documents": documents},
    }
    return tr.run_reference("pylate", folders["colbert"], inputs)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def _same_sparse(indices, values, ref_ids: np.ndarray, ref_values: np.ndarray) -> None:
    """Same token ids (ascending); weights within 1e-5 of the vector's largest weight, absolute:
    float32 rounding moves a logit near zero by ~1e-7, so that a weight near 0 (log1p(relu(x))
    of a tiny positive x) may differ by a large relative amount while nothing that matters
    changes. A pointwise relative tolerance would fail on those."""
    np.testing.assert_array_equal(np.asarray(indices), ref_ids)
    scale = float(np.abs(ref_values).max()) if len(ref_values) else 1.0
    np.testing.assert_allclose(np.asarray(values), ref_values, rtol=0, atol=1e-5 * scale)


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The smallest cosine between matching rows (both sides unit vectors)."""
    a, b = np.atleast_2d(a), np.atleast_2d(b)
    assert a.shape == b.shape
    return float((a * b).sum(axis=-1).min())


# -- SPLADE: /embed_sparse and outputs=["sparse"] ------------------------------------------------


def test_embed_sparse_equals_sparse_encoder(splade_server, folders):
    reference = tr.splade_reference(folders["splade"], TEXTS)
    r = post(splade_server, "/embed_sparse", {"inputs": TEXTS})
    assert r.status_code == 200, r.text
    got = r.json()
    assert len(got) == len(TEXTS)
    for vector, (ids, values) in zip(got, reference, strict=True):
        assert vector and all(set(x) == {"index", "value"} for x in vector)
        _same_sparse([x["index"] for x in vector], [x["value"] for x in vector], ids, values)

    # One text, alone in its steps: the same vector (its float32 rounding may differ).
    one = post(splade_server, "/embed_sparse", {"inputs": TEXTS[0], "truncate": True}).json()
    assert len(one) == 1
    ids, values = reference[0]
    _same_sparse([x["index"] for x in one[0]], [x["value"] for x in one[0]], ids, values)


def test_v1_embeddings_sparse_with_tokens_and_top_k(splade_server, folders):
    from transformers import AutoTokenizer

    reference = tr.splade_reference(folders["splade"], TEXTS)
    body = {"input": TEXTS, "outputs": ["sparse"], "return_tokens": True, "top_k": 5}
    r = post(splade_server, "/v1/embeddings", {"model": "tiny-splade", **body})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["model"] == "tiny-splade"
    tokenizer = AutoTokenizer.from_pretrained(str(folders["splade"]))
    lengths = [len(tokenizer(text)["input_ids"]) for text in TEXTS]
    assert answer["usage"] == {"prompt_tokens": sum(lengths), "total_tokens": sum(lengths)}
    for i, (item, (ids, values)) in enumerate(zip(answer["data"], reference, strict=True)):
        assert item["index"] == i and set(item) == {"object", "index", "sparse_embedding"}
        sparse = item["sparse_embedding"]
        top = np.sort(ids[np.argsort(-values, kind="stable")[:5]])
        _same_sparse(sparse["indices"], sparse["values"], top, values[np.isin(ids, top)])
        assert sparse["tokens"] == tokenizer.convert_ids_to_tokens(sparse["indices"])


# -- BGE-M3: every output from one request ---------------------------------------------------


def test_v1_embeddings_outputs_on_bge_m3_equal_flagembedding(m3_server, m3_reference):
    ref = m3_reference
    body = {
        "input": TEXTS,
        "outputs": ["multi_vector", "dense", "sparse"],
        "truncate_prompt_tokens": MAX_LENGTH,
        "encoding_format": "base64",
    }
    r = post(m3_server, "/v1/embeddings", body)
    assert r.status_code == 200, r.text
    answer = r.json()
    tokens = sum(len(ids) for ids in ref["input_ids"])
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    for i, item in enumerate(answer["data"]):
        assert set(item) == {"object", "index", "embedding", "sparse_embedding", "multi_vector"}
        # base64 applies to the dense vector only.
        dense = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
        assert _min_cosine(dense, ref["dense"][i]) >= 0.99999
        order = np.argsort(ref["lexical_ids"][i])
        ids, values = ref["lexical_ids"][i][order], ref["lexical_values"][i][order]
        sparse = item["sparse_embedding"]
        assert set(sparse) == {"indices", "values"}
        np.testing.assert_array_equal(sparse["indices"], ids)
        np.testing.assert_allclose(sparse["values"], values, rtol=0, atol=1e-5)
        colbert = np.array(item["multi_vector"], dtype=np.float32)
        assert _min_cosine(colbert, ref["colbert"][i]) >= 0.99999  # per token

    dense_only = post(m3_server, "/v1/embeddings", {"input": TEXTS[:2], "outputs": ["dense"]})
    assert [set(d) for d in dense_only.json()["data"]] == [{"object", "index", "embedding"}] * 2


def test_compute_score_m3_equals_flagembedding(folders, m3_reference):
    ref = m3_reference["score1"]  # one pair per batch: no padding in the reference's scores
    with pipepool.Engine(str(folders["m3"]), max_num_batched_tokens=BUDGET) as engine:
        got = pipepool.Retriever(engine).compute_score_m3(
            M3_PAIRS, weights=WEIGHTS, max_query_length=MAX_QUERY, max_passage_length=MAX_PASSAGE
        )
    assert set(got) == {"colbert", "sparse", "dense", "sparse+dense", "colbert+sparse+dense"}
    assert (ref["sparse"] > 0).any(), "no pair shares a weighted token: sparse is untested"
    for mode, values in got.items():
        np.testing.assert_allclose(values, ref[mode], rtol=0, atol=TOLERANCE, err_msg=mode)


def _m3_mix(ref: dict, pairs: slice, weights) -> np.ndarray:
    w_dense, w_sparse, w_colbert = weights
    mix = w_dense * ref["dense"] + w_sparse * ref["sparse"] + w_colbert * ref["colbert"]
    return (mix / sum(weights))[pairs]


def test_bge_m3_rerank_ranks_by_the_weighted_mix(m3_server, m3_reference):
    ref = m3_reference["score1"]
    docs = slice(0, len(DOCUMENTS))
    # The query is shorter than MAX_QUERY: truncate_prompt_tokens cuts the passages alone.
    cases = [({"weights": WEIGHTS}, ref["colbert+sparse+dense"][docs])]
    cases.append(({}, _m3_mix(ref, docs, [0.4, 0.2, 0.4])))  # FlagEmbedding's README weights
    for extra, expected in cases:
        body = {"query": QUERY, "documents": DOCUMENTS, "truncate_prompt_tokens": MAX_PASSAGE}
        r = post(m3_server, "/v1/rerank", {**body, **extra})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == np.argsort(-expected, kind="stable").tolist()
        for x in results:
            assert abs(x["relevance_score"] - expected[x["index"]]) <= TOLERANCE
    score = post(
        m3_server,
        "/score",
        {
            "text_1": QUERY,
            "text_2": DOCUMENTS,
            "weights": WEIGHTS,
            "truncate_prompt_tokens": MAX_PASSAGE,
        },
    ).json()
    got = np.array([d["score"] for d in score["data"]])
    np.testing.assert_allclose(got, ref["colbert+sparse+dense"][docs], rtol=0, atol=TOLERANCE)


# -- ColBERT: multi-vector outputs and MaxSim ------------------------------------------------


def test_colbert_rerank_equals_pylate(colbert_server, colbert_reference):
    ref = colbert_reference
    r = post(colbert_server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
    assert r.status_code == 200, r.text
    answer = r.json()
    results = answer["results"]
    assert [x["index"] for x in results] == ref["rerank_ids"].tolist()
    by_index = {x["index"]: x["relevance_score"] for x in results}
    assert by_index[0] == by_index[4], "documents 0 and 4 are the same text"
    for x in results:
        assert abs(x["relevance_score"] - ref["pair_scores"][x["index"]]) <= TOLERANCE
        assert x["document"] == {"text": DOCUMENTS[x["index"]]}
    # Usage: the query once (expanded to query_length), each document once, as PyLate feeds
    # them (document 4 repeats document 0's text: run once).
    tokens = len(ref["query_ids"][0]) + sum(len(ids) for ids in ref["document_ids"][:4])
    tokens += len(ref["document_ids"][5])
    assert answer["usage"]["prompt_tokens"] == tokens

    tei = post(colbert_server, "/rerank", {"query": QUERY, "texts": DOCUMENTS, "raw_scores": True})
    assert [x["index"] for x in tei.json()] == ref["rerank_ids"].tolist()
    score = post(colbert_server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    got = np.array([d["score"] for d in score["data"]])
    np.testing.assert_allclose(got, ref["pair_scores"], rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize(
    "path,option",
    [
        ("/v1/score", {"truncation_side": "left"}),
        ("/rerank", {"truncation_direction": "left"}),
        ("/v1/score", {"max_tokens_per_query": 4}),
        ("/v1/rerank", {"max_chunks_per_doc": 2}),
    ],
)
def test_late_interaction_refuses_joint_prompt_options_by_name(colbert_server, path, option):
    # Issue 56: these shape a cross-encoder's one prompt; ColBERT cuts query and document
    # apart, each at its end, so they are refused, never ignored.
    if path == "/v1/score":
        body = {"queries": QUERY, "documents": DOCUMENTS[:2], **option}
    else:
        body = {"query": QUERY, "documents": DOCUMENTS[:2], **option}
    r = post(colbert_server, path, body)
    assert r.status_code == 400, r.text
    name = "truncation_side" if "truncation_direction" in option else next(iter(option))
    assert r.json()["error"]["param"] == name and "late interaction" in r.text
    default_side = post(colbert_server, path, {**body, **dict.fromkeys(option, None)})
    assert default_side.status_code == 200, default_side.text


def test_colbert_multi_vector_outputs_equal_pylate(colbert_server, colbert_reference):
    ref = colbert_reference
    for is_query, texts, side in ((True, [QUERY], "query"), (False, DOCUMENTS, "document")):
        body = {"input": texts, "outputs": ["multi_vector"], "is_query": is_query}
        r = post(colbert_server, "/v1/embeddings", body)
        assert r.status_code == 200, r.text
        for item, expected in zip(r.json()["data"], ref[side], strict=True):
            assert _min_cosine(np.array(item["multi_vector"]), expected) >= 0.99999


# -- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "which,path,body,param,says",
    [
        ("splade", "/v1/embeddings", {"outputs": ["bogus"]}, "outputs", "bogus"),
        ("splade", "/v1/embeddings", {"outputs": []}, "outputs", "non-empty"),
        ("m3", "/v1/embeddings", {"outputs": ["sparse"], "dimensions": 8}, "dimensions", None),
        ("m3", "/v1/embeddings", {"outputs": ["sparse"], "top_k": 0}, "top_k", None),
        ("m3", "/v1/embeddings", {"outputs": ["sparse"], "long_inputs": "chunk"}, None, "chunk"),
        ("colbert", "/rerank", {"query": "q", "documents": ["a"], "weights": [1, 1, 1]},
         "weights", "BGE-M3"),
        ("colbert", "/rerank", {"query": "q", "documents": ["a"], "instruction": "x"},
         "instruction", None),
        ("m3", "/rerank", {"query": "q", "documents": ["a"], "weights": [1, 1]}, "weights", None),
        ("m3", "/score", {"text_1": "q", "text_2": "a", "weights": [0, 0, 0]}, "weights", None),
    ],
)  # fmt: skip
def test_bad_requests_get_a_400_with_an_error_body(
    request, which, path, body, param, says
):  # fmt: skip
    server = request.getfixturevalue(f"{which}_server")
    if path == "/v1/embeddings":
        body = {"input": ["some text"], **body}
    err = assert_error(post(server, path, body), 400, "invalid_request_error", param=param)
    if says is not None:
        assert says in err["message"], err


@pytest.mark.parametrize(
    "which,asked,gives",
    [
        ("splade", ["multi_vector"], "sparse"),
        ("splade", ["dense", "sparse"], "sparse"),
        ("colbert", ["sparse"], "multi_vector"),
    ],
)
def test_outputs_the_model_does_not_give_are_a_400_naming_those_it_gives(
    request, which, asked, gives
):
    server = request.getfixturevalue(f"{which}_server")
    r = post(server, "/v1/embeddings", {"input": ["some text"], "outputs": asked})
    err = assert_error(r, 400, "invalid_request_error", code="unsupported_output", param="outputs")
    missing = ", ".join(o for o in asked if o != gives)
    assert f"does not give {missing} outputs; it gives {gives}" in err["message"], err


@pytest.mark.parametrize(
    "which,path,body,says",
    [
        ("splade", "/v1/embeddings", {}, "embeddings"),
        ("splade", "/rerank", {"query": "q", "documents": ["a"]}, "reranking"),
    ],
)  # fmt: skip
def test_a_task_the_model_does_not_do_is_404_naming_what_it_does(request, which, path, body, says):
    """As OpenAI answers a model used on an endpoint it does not serve."""
    server = request.getfixturevalue(f"{which}_server")
    if path == "/v1/embeddings":
        body = {"input": ["some text"], **body}
    r = post(server, path, body)
    err = assert_error(r, 404, "invalid_request_error", code="unsupported_task", param="model")
    assert f"does not give {says}" in err["message"] and "What it does: " in err["message"], err


def test_tei_embed_sparse_of_a_model_without_sparse_outputs_is_424(colbert_server):
    """TEI's answer to a route the model does not serve: 424, its error body."""
    r = post(colbert_server, "/embed_sparse", {"inputs": ["a"]})
    assert r.status_code == 424 and r.json()["error_type"] == "Backend", r.text
    assert "does not give sparse outputs" in r.json()["error"]
