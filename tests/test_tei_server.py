"""Issue 56 item 3: text-embeddings-inference's surface on a real ``pipepool serve``, each route
as TEI (v1.9) answers it: ``POST /`` by the model's type (the official ``huggingface_hub``
``InferenceClient`` unchanged), ``/embed``, ``/embed_all``, ``/predict`` (texts and pairs),
``/similarity``, ``/decode``, token-id inputs, TEI's error body and statuses, ``/info``.
Answers are checked against sentence-transformers and transformers on the same weights."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tiny_retrieval as tr
import torch
from test_cross_encoder_api import make_nli_cross_encoder
from test_server import ServerProcess
from test_server_limits import assert_error
from tiny_models import SENTENCES

# Slow: real `pipepool serve` processes.
pytestmark = pytest.mark.slow

TOLERANCE = 1e-4
MAX_INPUTS = 8
TEXTS = SENTENCES[:4]
LONG = " ".join(SENTENCES)  # far over MiniLM's 256 tokens
PAIRS = [(SENTENCES[0], SENTENCES[1]), (SENTENCES[2], SENTENCES[3])]
JSON = {"content-type": "application/json"}
KEY = "tei-key"  # the reranker server's; the others take no key and ignore the header


@pytest.fixture(scope="module")
def folders(tmp_path_factory, minilm_path, cross_encoder_path) -> dict:
    root = tmp_path_factory.mktemp("tei-models")
    return {
        "minilm": minilm_path,
        "nli": make_nli_cross_encoder(root / "nli"),
        "splade": tr.build_splade(root / "splade"),
        "reranker": cross_encoder_path,
    }


def _serve(tmp_path_factory, name: str, models: list[tuple[str, object]], *extra: str):
    args = [arg for m, path in models for arg in ("--model", f"{m}={path}")]
    args += ["--max-inputs-per-request", str(MAX_INPUTS), *extra]
    s = ServerProcess(args, tmp_path_factory.mktemp(f"{name}-log") / "server.log")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):
    """An embedding model first (POST / embeds), then a SPLADE model; token ids taken."""
    models = [("minilm", folders["minilm"]), ("splade", folders["splade"])]
    yield from _serve(tmp_path_factory, "tei", models, "--allow-token-ids")


@pytest.fixture(scope="module")
def classifier_server(folders, tmp_path_factory):
    """A three-label classifier alone (POST / predicts)."""
    yield from _serve(tmp_path_factory, "tei-classifier", [("nli", folders["nli"])])


@pytest.fixture(scope="module")
def reranker_server(folders, tmp_path_factory):
    """A reranker first (POST / reranks), then an embedding model; no token ids; an API key."""
    models = [("reranker", folders["reranker"]), ("minilm", folders["minilm"])]
    yield from _serve(tmp_path_factory, "tei-reranker", models, "--api-key", KEY)


@pytest.fixture(scope="module")
def minilm(folders):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folders["minilm"]), device="cpu")


@pytest.fixture(scope="module")
def nli(folders):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = str(folders["nli"])
    return AutoTokenizer.from_pretrained(path), AutoModelForSequenceClassification.from_pretrained(
        path
    ).eval()


def post(server, path: str, body, key: str = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def ok(r: httpx.Response):
    assert r.status_code == 200, r.text
    return r.json()


def assert_tei_error(r: httpx.Response, status: int, error_type: str, says: str = "") -> str:
    """TEI's error body: exactly ``error`` and ``error_type``."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error", "error_type"} and body["error_type"] == error_type, body
    assert says in body["error"], body
    return body["error"]


def ids_of(minilm, text: str, side: str = "right", **options) -> list[int]:
    """MiniLM's token ids of ``text``, special tokens included; ``side``: the end a long text
    is cut from (with ``truncation``)."""
    tokenizer = minilm.tokenizer
    tokenizer.truncation_side = side
    try:
        return tokenizer(text, **options)["input_ids"]
    finally:
        tokenizer.truncation_side = "right"


# -- POST / and the official client -------------------------------------------------------------


def test_huggingface_hub_client_embeds_and_compares_through_root(server, minilm, monkeypatch):
    from huggingface_hub import InferenceClient, constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the tests' default: no hub

    client = InferenceClient(base_url=server.url)
    got = client.feature_extraction(TEXTS[0])
    expected = minilm.encode([TEXTS[0]])
    assert got.shape == (1, 384)
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)
    cosines = client.sentence_similarity(TEXTS[0], other_sentences=TEXTS[1:])
    vectors = minilm.encode(TEXTS)
    np.testing.assert_allclose(cosines, vectors[1:] @ vectors[0], atol=TOLERANCE)


def test_huggingface_hub_client_classifies_through_root(classifier_server, nli, monkeypatch):
    from huggingface_hub import InferenceClient, constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    client = InferenceClient(base_url=classifier_server.url)
    # TEI answers one text with a flat list; the client reads its first item, the top label.
    top = client.text_classification(TEXTS[0])
    (expected,) = _reference_predictions(nli, [TEXTS[0]])
    assert top.label == expected[0]["label"]
    assert abs(top.score - expected[0]["score"]) <= TOLERANCE
    with pytest.raises(Exception, match="422"):
        client.text_classification(TEXTS[0], top_k=1)  # not TEI's: refused, not ignored


def test_root_and_invocations_answer_as_the_first_models_route(
    server, classifier_server, reranker_server
):
    body = {"inputs": TEXTS[:2]}
    assert ok(post(server, "/", body)) == ok(post(server, "/embed", body))
    assert ok(post(server, "/invocations", body)) == ok(post(server, "/embed", body))
    predict = {"inputs": [[TEXTS[0]], list(PAIRS[0])]}
    assert ok(post(classifier_server, "/", predict)) == ok(
        post(classifier_server, "/predict", predict)
    )
    rerank = {"query": TEXTS[0], "texts": TEXTS[1:], "return_text": True}
    ranks = ok(post(reranker_server, "/", rerank))
    assert ranks == ok(post(reranker_server, "/rerank", rerank))
    assert sorted(r["index"] for r in ranks) == [0, 1, 2] and ranks[0]["text"] in TEXTS[1:]
    # Each form's own validation, TEI's error body.
    assert_tei_error(post(server, "/", {"input": "a"}), 422, "Validation", "input")
    r = post(reranker_server, "/", {"query": "q", "documents": ["a"]})
    assert_tei_error(r, 422, "Validation", "query and texts")
    r = httpx.post(server.url + "/", content=b"{not json", headers=JSON)
    assert_tei_error(r, 422, "Validation", "not valid JSON")
    r = httpx.post(server.url + "/", content=b'{"inputs": "a"}', headers={"content-type": "x"})
    assert_tei_error(r, 422, "Validation", "Content-Type: application/json")


# -- /embed ---------------------------------------------------------------------------------------


def test_embed_honours_normalize_dimensions_and_truncation(server, minilm):
    raw = minilm.encode(TEXTS, normalize_embeddings=False)  # MiniLM's own Normalize module
    unit = raw / np.linalg.norm(raw, axis=1, keepdims=True)
    np.testing.assert_allclose(ok(post(server, "/embed", {"inputs": TEXTS})), unit, atol=TOLERANCE)
    cut = ok(post(server, "/embed", {"inputs": TEXTS, "dimensions": 32}))
    short = unit[:, :32] / np.linalg.norm(unit[:, :32], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, short, atol=TOLERANCE)
    # TEI's truncation: right keeps the start, left the end, false refuses (422).
    right = ids_of(minilm, LONG, truncation=True, max_length=256)
    left = ids_of(minilm, LONG, "left", truncation=True, max_length=256)
    assert left[0] == right[0] and left[1:-1] != right[1:-1]  # [CLS] kept, the text's end
    for direction, ids in (("right", right), ("Left", left)):
        body = {"inputs": LONG, "truncate": True, "truncation_direction": direction}
        by_text = ok(post(server, "/embed", body))
        by_ids = ok(post(server, "/embed", {"inputs": ids}))
        np.testing.assert_allclose(by_text, by_ids, atol=TOLERANCE)
    assert not np.allclose(
        ok(post(server, "/embed", {"inputs": LONG, "truncation_direction": "left"})),
        ok(post(server, "/embed", {"inputs": LONG})),
        atol=1e-3,
    )
    r = post(server, "/embed", {"inputs": LONG, "truncate": False})
    assert_tei_error(r, 422, "Validation", "256")


def test_normalize_false_gives_the_pooled_vector(server, folders):
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folders["minilm"]))
    model = AutoModel.from_pretrained(str(folders["minilm"])).eval()
    batch = tokenizer(TEXTS[:2], padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    mean = ((hidden * mask).sum(1) / mask.sum(1)).numpy()
    got = ok(post(server, "/embed", {"inputs": TEXTS[:2], "normalize": False}))
    np.testing.assert_allclose(got, mean, atol=TOLERANCE)


def test_token_ids_are_inputs_on_embed_embed_all_and_embed_sparse(server, minilm):
    ids = [ids_of(minilm, t) for t in TEXTS[:2]]
    for route in ("/embed", "/embed_all", "/embed_sparse"):
        by_text = ok(post(server, route, {"inputs": TEXTS[:2]}))
        assert ok(post(server, route, {"inputs": ids})) == by_text, route
        assert ok(post(server, route, {"inputs": ids[0]})) == by_text[:1], route
    r = post(server, "/embed", {"inputs": [ids[0], TEXTS[1]]})
    assert_tei_error(r, 422, "Validation", "all strings or all lists of token ids")
    r = post(server, "/embed", {"inputs": [ids[0] + [10**6]]})
    assert_tei_error(r, 422, "Validation", "vocabulary")


def test_token_ids_are_refused_without_allow_token_ids(reranker_server):
    for route in ("/embed", "/embed_all"):
        r = post(reranker_server, route, {"inputs": [101, 7592, 102]})
        assert_tei_error(r, 422, "Validation", "--allow-token-ids")


# -- /embed_all -----------------------------------------------------------------------------------


def test_embed_all_is_every_tokens_hidden_state(server, folders):
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folders["minilm"]))
    model = AutoModel.from_pretrained(str(folders["minilm"])).eval()
    got = ok(post(server, "/embed_all", {"inputs": TEXTS[:2]}))
    for text, matrix in zip(TEXTS[:2], got, strict=True):
        with torch.no_grad():
            hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
        np.testing.assert_allclose(np.array(matrix), hidden.numpy(), atol=TOLERANCE)
    cut = ok(post(server, "/embed_all", {"inputs": LONG, "truncate": True}))
    assert len(cut[0]) == 256 and len(cut[0][0]) == 384


# -- /predict -------------------------------------------------------------------------------------


def _reference_predictions(nli, sequences, raw: bool = False, **options) -> list[list[dict]]:
    tokenizer, model = nli
    out = []
    for seq in sequences:
        args = (seq,) if isinstance(seq, str) else seq
        with torch.no_grad():
            logits = model(**tokenizer(*args, return_tensors="pt", **options)).logits[0]
        scores = logits if raw else logits.softmax(-1)
        labels = [model.config.id2label[i] for i in range(len(scores))]
        order = torch.argsort(-scores, stable=True).tolist()
        out.append([{"score": float(scores[i]), "label": labels[i]} for i in order])
    return out


def _same_predictions(got, expected) -> None:
    assert [[p["label"] for p in g] for g in got] == [[p["label"] for p in e] for e in expected]
    np.testing.assert_allclose(
        [[p["score"] for p in g] for g in got],
        [[p["score"] for p in e] for e in expected],
        atol=TOLERANCE,
    )


def test_predict_takes_a_text_a_pair_and_a_batch_of_both(classifier_server, nli):
    got = ok(post(classifier_server, "/predict", {"inputs": TEXTS[0]}))
    _same_predictions([got], _reference_predictions(nli, [TEXTS[0]]))
    got = ok(post(classifier_server, "/predict", {"inputs": list(PAIRS[0]), "raw_scores": True}))
    _same_predictions([got], _reference_predictions(nli, [PAIRS[0]], raw=True))
    batch = [[TEXTS[0]], list(PAIRS[1]), [TEXTS[2]]]
    got = ok(post(classifier_server, "/predict", {"inputs": batch}))
    _same_predictions(got, _reference_predictions(nli, [TEXTS[0], PAIRS[1], TEXTS[2]]))


def test_predict_truncates_as_asked(classifier_server, nli):
    for side in ("right", "left"):
        body = {"inputs": LONG, "truncate": True, "truncation_direction": side}
        got = ok(post(classifier_server, "/predict", body))
        options = {"truncation": True, "max_length": 512}
        nli[0].truncation_side = side
        try:
            _same_predictions([got], _reference_predictions(nli, [LONG], **options))
        finally:
            nli[0].truncation_side = "right"
    r = post(classifier_server, "/predict", {"inputs": [LONG] * 2, "truncate": False})
    assert_tei_error(r, 422, "Validation", "more than max_model_len=512")
    r = post(
        classifier_server, "/predict", {"inputs": list(PAIRS[0]), "truncation_direction": "left"}
    )
    assert_tei_error(r, 422, "Validation", "truncation_direction")


# -- /similarity and /decode -----------------------------------------------------------------------


def test_similarity_is_the_cosine_to_the_source(server, minilm):
    body = {
        "inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]},
        "parameters": {"truncate": True, "truncation_direction": "left"},
    }
    vectors = minilm.encode(TEXTS)
    np.testing.assert_allclose(
        ok(post(server, "/similarity", body)), vectors[1:] @ vectors[0], atol=TOLERANCE
    )


def test_decode_gives_the_tokenizers_text(server, minilm):
    ids = [ids_of(minilm, t) for t in TEXTS[:2]]
    tokenizer = minilm.tokenizer
    assert ok(post(server, "/decode", {"ids": ids[0]})) == [
        tokenizer.decode(ids[0], skip_special_tokens=True)
    ]
    got = ok(post(server, "/decode", {"ids": ids, "skip_special_tokens": False}))
    assert got == [tokenizer.decode(i, skip_special_tokens=False) for i in ids]
    assert got[0].startswith("[CLS]")


# -- errors: TEI's body and statuses on TEI routes, OpenAI's elsewhere ----------------------------

TEI_ERRORS = [
    ("/embed", {"inputs": []}, 400, "Empty", "cannot be empty"),
    ("/embed", {"inputs": ["a", ""]}, 400, "Empty", "`inputs` 1 cannot be empty"),
    ("/embed", {"inputs": ["a"] * (MAX_INPUTS + 1)}, 413, "Validation", f"at most {MAX_INPUTS}"),
    # A body over refusal_pacing.PACED_BODY_BYTES: its refusal is held, and is the same.
    (
        "/tokenize",
        {"inputs": ["word " * 6000] * (MAX_INPUTS + 1), "model": "minilm"},
        413,
        "Validation",
        f"at most {MAX_INPUTS}",
    ),
    ("/embed", {"inputs": "a", "encoding_format": "base64"}, 422, "Validation", "encoding_format"),
    ("/embed", {"inputs": "a", "normalize": None}, 422, "Validation", "normalize"),
    ("/embed", {"inputs": "a", "normalize": "true"}, 422, "Validation", "boolean"),
    ("/embed", {"inputs": "a", "truncate": 0}, 422, "Validation", "truncate"),
    ("/embed", {"inputs": "a", "dimensions": 0}, 422, "Validation", "dimensions"),
    ("/embed", {"inputs": "a", "dimensions": 385}, 422, "Validation", "dimensions"),
    ("/embed", {"inputs": "a", "prompt_name": "query"}, 422, "Validation", "prompt_name"),
    ("/embed", {"inputs": {"a": 1}}, 422, "Validation", "inputs: must be a text"),
    ("/embed_all", {"inputs": "a", "normalize": True}, 422, "Validation", "normalize"),
    (
        "/embed_all",
        {"inputs": "a", "truncation_direction": "up"},
        422,
        "Validation",
        "truncation_direction",
    ),
    ("/embed_sparse", {"inputs": []}, 400, "Empty", "cannot be empty"),
    ("/predict", {"inputs": ["a", "b", "c"]}, 422, "Validation", "3 texts"),
    ("/predict", {"inputs": [["a", "b", "c"]]}, 422, "Validation", "inputs 0 has 3 texts"),
    ("/predict", {"inputs": ""}, 400, "Empty", "cannot be empty"),
    ("/predict", {"inputs": [["a"]] * (MAX_INPUTS + 1)}, 413, "Validation", "at most"),
    ("/predict", {"inputs": "a", "top_k": 1}, 422, "Validation", "top_k"),
    (
        "/similarity",
        {"inputs": {"source_sentence": "a", "sentences": []}},
        400,
        "Empty",
        "sentences",
    ),
    (
        "/similarity",
        {"inputs": {"source_sentence": "a", "sentences": ["b"] * MAX_INPUTS}},
        413,
        "Validation",
        f"{MAX_INPUTS + 1} inputs",
    ),
    (
        "/similarity",
        {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "parameters": {"x": 1}},
        422,
        "Validation",
        "parameters.x",
    ),
    ("/decode", {"ids": []}, 400, "Empty", "`input_ids` cannot be empty"),
    ("/decode", {"ids": [[1], []]}, 400, "Empty", "`ids` 1 cannot be empty"),
    ("/decode", {"ids": [40000]}, 422, "Validation", "outside this model's vocabulary"),
    ("/decode", {"ids": [1], "skip_special_tokens": 0}, 422, "Validation", "skip_special_tokens"),
]


@pytest.mark.parametrize(("path", "body", "status", "error_type", "says"), TEI_ERRORS)
def test_tei_routes_answer_tei_errors(request, path, body, status, error_type, says):
    # /predict needs a classifier; the other routes an embedding model.
    server = request.getfixturevalue("classifier_server" if path == "/predict" else "server")
    assert_tei_error(post(server, path, body), status, error_type, says)


def test_tei_forms_of_shared_routes_answer_tei_errors(reranker_server, server):
    """/rerank with ``texts`` and /tokenize with ``inputs`` are TEI's requests: TEI's errors,
    from validation and from the route alike; the other peers' forms keep OpenAI's."""
    r = post(reranker_server, "/rerank", {"query": "a", "texts": []})
    assert_tei_error(r, 400, "Empty", "texts is empty")
    r = post(reranker_server, "/rerank", {"query": "a", "texts": ["b"], "top_k": 1})
    assert_tei_error(r, 422, "Validation", "top_k")
    r = post(reranker_server, "/rerank", {"query": "a", "texts": "b"})
    assert_tei_error(r, 422, "Validation", "texts")
    r = post(server, "/tokenize", {"model": "minilm", "inputs": "a", "return_token_strs": True})
    assert_tei_error(r, 422, "Validation", "return_token_strs")
    r = post(server, "/tokenize", {"model": "minilm", "inputs": "a", "x": 1})
    assert_tei_error(r, 422, "Validation", "x")
    assert_error(post(reranker_server, "/rerank", {"query": "a", "documents": []}), 400,
                 "invalid_request_error", param="documents")  # fmt: skip
    r = post(server, "/tokenize", {"model": "minilm", "prompt": "a", "x": 1})
    assert_error(r, 400, "invalid_request_error")


def test_a_lone_surrogate_is_422_and_the_connection_serves_on(server):
    with httpx.Client(timeout=30, headers=JSON) as http:
        r = http.post(server.url + "/embed", content=rb'{"inputs": ["ok", "x\ud800"]}')
        assert_tei_error(r, 422, "Validation", "inputs 1 is not valid Unicode")
        assert r.headers.get("connection") != "close"
        assert http.post(server.url + "/embed", json={"inputs": "fine"}).status_code == 200


def test_a_route_the_model_cannot_serve_is_424_backend(classifier_server, server):
    for path, body in [
        ("/embed", {"inputs": "a"}),
        ("/embed_all", {"inputs": "a"}),
        ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}}),
        ("/embed_sparse", {"inputs": "a"}),
    ]:
        assert_tei_error(post(classifier_server, path, body), 424, "Backend", "nli")
    assert_tei_error(post(server, "/predict", {"inputs": "a"}), 424, "Backend", "can do classify")


def test_openai_routes_keep_the_openai_error_body(server):
    r = post(server, "/v1/embeddings", {"model": "minilm", "input": []})
    assert_error(r, 400, "invalid_request_error", param="input")
    r = httpx.get(server.url + "/embed")
    assert_tei_error(r, 405, "Validation", "Method Not Allowed")


# -- /info ----------------------------------------------------------------------------------------

# TEI's Info: every field it requires, with its JSON type.
INFO_FIELDS = {
    "model_id": str,
    "model_dtype": str,
    "served_model_name": str,
    "model_type": dict,
    "max_concurrent_requests": int,
    "max_input_length": int,
    "max_batch_tokens": int,
    "max_client_batch_size": int,
    "auto_truncate": bool,
    "tokenization_workers": int,
    "version": str,
}


def test_info_names_tei_fields_with_the_servers_values(server, classifier_server, reranker_server):
    import pipepool

    info = ok(httpx.get(server.url + "/info"))
    for field, kind in INFO_FIELDS.items():
        assert isinstance(info[field], kind), (field, info[field])
    assert info["model_id"] == info["served_model_name"] == "minilm"
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["model_dtype"] == "float32" and info["max_input_length"] == 256
    assert info["max_client_batch_size"] == MAX_INPUTS and info["auto_truncate"] is True
    assert info["version"] == pipepool.__version__ and info["tokenization_workers"] >= 1
    assert info["max_batch_requests"] >= 1 and info["max_batch_tokens"] >= 256
    assert {"model_sha", "sha", "docker_label"} <= set(info)
    labels = {"0": "LABEL_0", "1": "LABEL_1", "2": "LABEL_2"}
    assert ok(httpx.get(classifier_server.url + "/info"))["model_type"] == {
        "classifier": {"id2label": labels, "label2id": {v: int(k) for k, v in labels.items()}}
    }
    reranker_info = httpx.get(
        reranker_server.url + "/info", headers={"Authorization": f"Bearer {KEY}"}
    )
    assert list(ok(reranker_info)["model_type"]) == ["reranker"]


def test_a_missing_api_key_is_401_in_teis_body(reranker_server):
    r = post(reranker_server, "/embed", {"inputs": "a"}, key="wrong")
    assert_tei_error(r, 401, "Unauthorized", "Incorrect API key")
    assert r.headers["www-authenticate"] == "Bearer"
