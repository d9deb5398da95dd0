"""Issue 13 item 4: a real ``pipepool serve`` of a cross-encoder answers Cohere v2 / Jina
``/rerank`` (the official cohere client unchanged), TEI's rerank form, vLLM's ``/score`` and
``/classify``, with the limits, error bodies, metrics and API key of ``/v1/embeddings``; the
scores are sentence-transformers' CrossEncoder's on the same weights."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from test_server import ServerProcess
from test_server_limits import assert_error
from tiny_models import SENTENCES, long_prompts

import pipepool

# Slow: real `pipepool serve` processes.
pytestmark = pytest.mark.slow

KEY = "rerank-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "ms-marco-tiny"
MAX_INPUTS = 16
TOLERANCE = 1e-4
QUERY = "How do pipeline stages stay in lockstep?"
DOCUMENTS = [*long_prompts()[:5], *SENTENCES[10:14]]


@pytest.fixture(scope="module")
def server(cross_encoder_path, tmp_path_factory):
    args = ["--model", str(cross_encoder_path), "--served-model-name", MODEL, "--api-key", KEY]
    args += ["--max-inputs-per-request", str(MAX_INPUTS), "--max-num-batched-tokens", "64"]
    s = ServerProcess(args, tmp_path_factory.mktemp("rerank-log") / "server.log")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def expected(cross_encoder_path) -> dict:
    """CrossEncoder's scores (this checkpoint's activation is Identity: raw logits), ranking,
    and each pair's token count."""
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer

    model = CrossEncoder(str(cross_encoder_path), device="cpu")
    scores = model.predict([(QUERY, d) for d in DOCUMENTS], show_progress_bar=False)
    tokenizer = AutoTokenizer.from_pretrained(str(cross_encoder_path))
    tokens = [len(tokenizer(QUERY, d, truncation=True)["input_ids"]) for d in DOCUMENTS]
    order = np.argsort(-scores, kind="stable").tolist()
    return {"scores": scores, "order": order, "tokens": sum(tokens)}


def post(server, path: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


# -- the cohere client ----------------------------------------------------------------------


def test_cohere_client_v2_reranks_like_cross_encoder(server, expected):
    import cohere

    client = cohere.ClientV2(base_url=server.url, api_key=KEY)
    response = client.rerank(model=MODEL, query=QUERY, documents=DOCUMENTS, top_n=3)
    assert [r.index for r in response.results] == expected["order"][:3]
    got = np.array([r.relevance_score for r in response.results])
    assert np.abs(got - expected["scores"][expected["order"][:3]]).max() <= TOLERANCE
    assert response.id.startswith("rerank-")
    assert response.meta.billed_units.search_units == 1

    with pytest.raises(cohere.errors.BadRequestError) as bad:
        client.rerank(model=MODEL, query=QUERY, documents=[])
    assert "documents is empty" in bad.value.body["error"]["message"]
    with pytest.raises(cohere.errors.UnauthorizedError):
        cohere.ClientV2(base_url=server.url, api_key="wrong").rerank(
            model=MODEL, query=QUERY, documents=DOCUMENTS
        )


# -- the routes and their shapes ----------------------------------------------------------------


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_routes_answer_in_the_cohere_and_jina_shape(server, expected, path):
    # Jina and Cohere v1 send documents as {"text": ...} objects; plain strings work too.
    documents = [{"text": d} if i % 2 else d for i, d in enumerate(DOCUMENTS)]
    r = post(server, path, {"model": MODEL, "query": QUERY, "documents": documents})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"id", "model", "results", "usage", "meta"}
    assert body["model"] == MODEL and body["id"].startswith("rerank-")
    assert [x["index"] for x in body["results"]] == expected["order"]
    for x in body["results"]:
        assert abs(x["relevance_score"] - expected["scores"][x["index"]]) <= TOLERANCE
        assert x["document"] == {"text": DOCUMENTS[x["index"]]}
    tokens = expected["tokens"]
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}

    body = {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False}
    short = post(server, path, body).json()
    assert [x["index"] for x in short["results"]] == expected["order"][:2]
    assert all("document" not in x for x in short["results"])


def test_rerank_in_tei_form_answers_as_tei(server, expected):
    body = {"query": QUERY, "texts": DOCUMENTS, "return_text": True, "raw_scores": True}
    got = post(server, "/rerank", body).json()
    assert [x["index"] for x in got] == expected["order"]
    assert all(x["text"] == DOCUMENTS[x["index"]] for x in got)
    assert all(abs(x["score"] - expected["scores"][x["index"]]) <= TOLERANCE for x in got)


def test_score_one_to_many_and_pairwise(server, expected):
    one = post(server, "/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [d["index"] for d in one["data"]] == list(range(len(DOCUMENTS)))
    assert np.abs(np.array([d["score"] for d in one["data"]]) - expected["scores"]).max() <= (
        TOLERANCE
    )
    pairwise = post(
        server, "/v1/score", {"model": MODEL, "text_1": [QUERY] * 2, "text_2": DOCUMENTS[:2]}
    ).json()
    assert pairwise["object"] == "list" and pairwise["model"] == MODEL
    assert [d["object"] for d in pairwise["data"]] == ["score", "score"]
    assert abs(pairwise["data"][1]["score"] - expected["scores"][1]) <= TOLERANCE


def test_classify_returns_probabilities_and_labels(server, cross_encoder_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    texts = DOCUMENTS[:3]
    tokenizer = AutoTokenizer.from_pretrained(str(cross_encoder_path))
    model = AutoModelForSequenceClassification.from_pretrained(str(cross_encoder_path)).eval()
    with torch.no_grad():
        logits = [model(**tokenizer(t, return_tensors="pt")).logits[0].tolist() for t in texts]
    body = post(server, "/classify", {"input": texts}).json()
    assert [d["label"] for d in body["data"]] == ["LABEL_0"] * 3
    assert [d["num_classes"] for d in body["data"]] == [1] * 3
    # ms-marco-MiniLM's sentence-transformers activation is Identity: probs are the logits.
    assert np.abs(np.array([d["probs"] for d in body["data"]]) - np.array(logits)).max() <= (
        TOLERANCE
    )


# -- bad input: 4xx with an error body -----------------------------------------------------------


@pytest.mark.parametrize(
    "path,body,status,param,says",
    [
        ("/rerank", {"query": QUERY, "documents": []}, 400, "documents", "documents is empty"),
        ("/v2/rerank", {"query": QUERY, "documents": ["a"], "top_n": -1}, 400, "top_n", None),
        ("/rerank", {"documents": ["a"]}, 400, "query", "query"),
        ("/rerank", {"query": QUERY, "documents": ["a"] * 17}, 400, "documents", "at most 16"),
        ("/rerank", {"query": "q", "documents": ["a"], "instruction": "x"}, 400, "instruction", ""),
        ("/rerank", {"model": "gpt-4", "query": "q", "documents": ["a"]}, 404, "model", None),
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, 400, "text_1", None),
        ("/classify", {"input": []}, 400, "input", "input is empty"),
        ("/v1/embeddings", {"input": "a"}, 404, "model", "does not give embeddings"),
    ],
)
def test_bad_requests_get_a_4xx_with_an_error_body(server, path, body, status, param, says):
    assert_error(post(server, path, body), status, "invalid_request_error", param=param, says=says)


def test_tei_info_says_reranker(server):
    info = httpx.get(server.url + "/info", headers=AUTH).json()
    assert info["model_type"] == {
        "reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
    }


def test_scoring_routes_need_the_api_key(server):
    r = post(server, "/rerank", {"query": "q", "documents": ["a"]}, headers={})
    assert_error(r, 401, "authentication_error", code="invalid_api_key")


def test_metrics_count_the_scoring_routes(server):
    post(server, "/rerank", {"query": QUERY, "documents": DOCUMENTS[:1]})
    post(server, "/rerank", {"query": QUERY, "documents": []})
    m = server.metrics()
    assert m['pipepool_http_requests_total{route="/rerank",status="200"}'] >= 1
    assert m['pipepool_http_requests_total{route="/rerank",status="400"}'] >= 1


# -- a model that cannot rerank -------------------------------------------------------------------


def test_an_embedding_model_answers_404_to_rerank_score_and_classify(bert_path):
    from fastapi.testclient import TestClient

    from pipepool.server.app import build_app
    from pipepool.server.front import AsyncEngine
    from pipepool.server.models import ServedModels
    from pipepool.server.owner import EngineOwner
    from pipepool.server.settings import ServerSettings

    owner = EngineOwner(lambda: pipepool.Engine(str(bert_path), device="cpu"))
    owner.start(on_failure=lambda exc: None)
    owner.loaded.wait()
    front = AsyncEngine(owner, max_queued=64)
    try:
        models = ServedModels.one(front, ("tiny-bert",))
        with TestClient(build_app(ServerSettings(), models)) as client:
            for path, body in (
                ("/rerank", {"query": "q", "documents": ["a", "b"]}),
                ("/score", {"text_1": "q", "text_2": "a"}),
                ("/classify", {"input": "a"}),
            ):
                r = client.post(path, json=body)
                err = assert_error(r, 404, "invalid_request_error", "unsupported_task", "model")
                assert "does not give" in err["message"] and "What it does: embed" in err["message"]
            assert client.post("/v1/embeddings", json={"input": "a"}).status_code == 200
    finally:
        front.close()
        owner.close()
