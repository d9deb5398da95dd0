"""sentence-transformers 6 MultiVectorEncoder folders run as multi-vector models (issue 56
item 5): every token vector equals sentence-transformers' own ``encode_query`` /
``encode_document`` (cos >= 0.99999, same count), on every engine kind, with a token budget
smaller than the longer prompts (they are chunked), and over HTTP from ``pipepool serve``
(``/v1/embeddings`` outputs, ``/v1/rerank`` MaxSim scores); settings pipepool does not apply
are refused by name."""

from __future__ import annotations

import json
import shutil

import httpx
import numpy as np
import pytest
import tiny_multi_vector
from test_server import ServerProcess

from pipepool import Engine, ModelLoadError, Retriever

BUDGET = 24  # tokens per step: the long texts below take several
QUERIES = [
    "what is late interaction?",
    "a query long enough to be cut at the query length, whatever its expansion says, surely",
    "x",
]
DOCUMENTS = [
    "ColBERT scores documents by MaxSim over token vectors, with punctuation!",
    "short doc.",
    "word, the word; " * 30,
    "the late interaction: every query token finds its best document token",
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("multi-vector")
    return {
        layout: tiny_multi_vector.build_multi_vector(root / layout, layout, seed=i)
        for i, layout in enumerate(tiny_multi_vector.LAYOUTS)
    }


@pytest.fixture(scope="module")
def references(folders) -> dict:
    return {
        layout: tiny_multi_vector.reference(path, QUERIES, DOCUMENTS)
        for layout, path in folders.items()
    }


def _assert_same_vectors(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.shape == theirs.shape
        cos = (mine * theirs).sum(axis=1) / (
            np.linalg.norm(mine, axis=1) * np.linalg.norm(theirs, axis=1)
        )
        assert cos.min() >= 0.99999, cos
        np.testing.assert_allclose(
            np.linalg.norm(mine, axis=1), np.linalg.norm(theirs, axis=1), rtol=1e-4
        )


@pytest.mark.parametrize("layout", list(tiny_multi_vector.LAYOUTS))
def test_multi_vector_encoder_equals_sentence_transformers(
    folders, references, engine_kind, layout
):
    with Engine(str(folders[layout]), max_num_batched_tokens=BUDGET, **engine_kind) as engine:
        assert engine.info.outputs == ("multi_vector",)
        queries = Retriever(engine).embed_multi_vector(QUERIES, is_query=True)
        documents = Retriever(engine).embed_multi_vector(DOCUMENTS)
    _assert_same_vectors(queries, references[layout]["query"])
    _assert_same_vectors(documents, references[layout]["document"])


def test_the_layouts_exercise_what_they_claim(references):
    """Guards the fixtures: 'fixed' queries all have 12 vectors (expansion) and skipping drops
    document tokens; 'min' pads short queries to 8 and keeps long ones past it (cut at 20,
    less the skipped "the" and ",")."""
    fixed, low = references["fixed"], references["min"]
    assert [len(q) for q in fixed["query"]] == [12, 12, 12]
    assert len(low["query"][2]) == 8 and 8 < len(low["query"][1]) < 20
    assert len(fixed["document"][2]) < 64 and len(low["document"][2]) > 64


@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):
    args = ["--model", str(folders["fixed"]), "--max-num-batched-tokens", str(BUDGET)]
    s = ServerProcess(args, tmp_path_factory.mktemp("multi-vector-log") / "server.log")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def test_served_vectors_and_rerank_scores_equal_sentence_transformers(server, references):
    ref = references["fixed"]
    for is_query, texts, side in ((True, QUERIES, "query"), (False, DOCUMENTS, "document")):
        body = {"input": texts, "outputs": ["multi_vector"], "is_query": is_query}
        r = httpx.post(server.url + "/v1/embeddings", json=body, timeout=120)
        assert r.status_code == 200, r.text
        got = [np.asarray(item["multi_vector"], np.float32) for item in r.json()["data"]]
        _assert_same_vectors(got, ref[side])
    r = httpx.post(
        server.url + "/v1/rerank", json={"query": QUERIES[0], "documents": DOCUMENTS}, timeout=120
    )
    assert r.status_code == 200, r.text
    query = ref["query"][0]
    maxsim = [float((query @ doc.T).max(axis=1).sum()) for doc in ref["document"]]
    got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    np.testing.assert_allclose([got[i] for i in range(len(DOCUMENTS))], maxsim, atol=1e-4)


def _copy(folder, tmp_path):
    target = tmp_path / folder.name
    shutil.copytree(folder, target)
    return target


def _edit(path, change) -> None:
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("file", "change", "named"),
    [
        ("2_MultiVectorMask/config.json",
         lambda c: c.update(keep_only_token_ids=[5]), "keep_only_token_ids"),
        ("2_MultiVectorMask/config.json", lambda c: c.update(extra_option=1), "extra_option"),
        ("config_sentence_transformers.json",
         lambda c: c.update(similarity_fn_name="meanmaxsim"), "meanmaxsim"),
        ("sentence_bert_config.json",
         lambda c: c["query_expansion"].update(strategy="dynamic"), "dynamic"),
        ("sentence_bert_config.json",
         lambda c: c["query_expansion"].update(stride=2), "stride"),
        ("sentence_bert_config.json", lambda c: c.update(query_length=4), "query_length"),
        ("1_Dense/config.json",
         lambda c: c.update(module_input_name="sentence_embedding"), "module_input_name"),
        ("3_Normalize/config.json",
         lambda c: c.update(module_input_name="sentence_embedding"), "Normalize"),
        ("modules.json", lambda c: c.append({"idx": 4, "name": "4", "path": "4_Pool",
         "type": "sentence_transformers.multi_vector_encoder.modules.token_pooling."
                 "HierarchicalTokenPooling"}), "HierarchicalTokenPooling"),
        ("modules.json", lambda c: c.pop(2), "MultiVectorMask"),
    ],
)  # fmt: skip
def test_settings_pipepool_does_not_apply_are_refused_by_name(
    folders, tmp_path, file, change, named
):
    folder = _copy(folders["fixed"], tmp_path)
    _edit(folder / file, change)
    with pytest.raises(ModelLoadError, match=named):
        Engine(str(folder))
