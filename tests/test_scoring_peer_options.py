"""Issue 56: every option of the scoring routes keeps its peer's meaning, over HTTP against a
real ``pipepool serve`` of a reranker (bge-reranker-v2-m3's shape: XLM-R pairs, sigmoid
scores), each answer computed again with transformers on the same weights: vLLM's ``/score``
spellings and pairing rules, ``truncation_side`` on /score, /rerank and /classify,
``max_tokens_per_query`` / ``max_tokens_per_doc``, TEI's ``truncate`` and
``truncation_direction``, ``raw_scores`` and ``return_text``, Cohere v1's object documents with
``rank_fields``, its chunking of long documents (``max_chunks_per_doc``), and vLLM's shared
fields. Each test flips an option and sees the answer change as the peer's semantics say."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from test_server import ServerProcess
from test_server_limits import assert_error
from test_tei_server import assert_tei_error
from tiny_models import SENTENCES, long_prompts

# Slow: real `pipepool serve` processes.
pytestmark = pytest.mark.slow

MODEL = "bge-reranker-tiny"
MAX_LEN = 128  # the server's max_model_len: the longer documents below are over it
TOLERANCE = 1e-4
QUERY = "How do pipeline stages stay in lockstep?"
DOCUMENTS = [*long_prompts()[1:4], SENTENCES[10], SENTENCES[11]]


@pytest.fixture(scope="module")
def server(xlmr_reranker_path, tmp_path_factory):
    args = ["--model", str(xlmr_reranker_path), "--served-model-name", MODEL]
    args += ["--max-model-len", str(MAX_LEN), "--long-inputs", "error", "--allow-token-ids"]
    s = ServerProcess(args, tmp_path_factory.mktemp("scoring-log") / "server.log")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


class Reference:
    """The reranker in transformers: sigmoid of its logit, prompts built by its tokenizer."""

    def __init__(self, path) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()

    def run(self, ids: list[int], activation: bool = True) -> float:
        with torch.no_grad():
            logit = self.model(input_ids=torch.tensor([ids])).logits[0, 0]
        return float(torch.sigmoid(logit) if activation else logit)

    def pairs(self, queries, documents, *, max_length=None, side="right", activation=True):
        self.tokenizer.truncation_side = side
        out = []
        for q, d in zip(queries, documents, strict=True):
            ids = self.tokenizer(q, d, truncation=max_length is not None, max_length=max_length)
            out.append(self.run(ids["input_ids"], activation))
        return np.array(out)

    def texts(self, texts, *, max_length, side):
        self.tokenizer.truncation_side = side
        return np.array(
            [
                self.run(self.tokenizer(t, truncation=True, max_length=max_length)["input_ids"])
                for t in texts
            ]
        )

    def first_tokens(self, text: str, n: int) -> str:
        """The text up to the end of its n-th token (Cohere's and vLLM's per-text cut)."""
        spans = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = spans["offset_mapping"]
        return text if len(offsets) <= n else text[: offsets[n - 1][1]]

    def best_chunk(self, query: str, document: str, max_chunks: int) -> float:
        """Cohere's chunking: the document's token windows beside the whole query, each filling
        a prompt of MAX_LEN tokens (the tokenizer's overflowing windows of an only_second
        truncation); the best of the first max_chunks windows."""
        self.tokenizer.truncation_side = "right"
        windows = self.tokenizer(
            query, document, truncation="only_second", max_length=MAX_LEN,
            return_overflowing_tokens=True,
        )["input_ids"]  # fmt: skip
        return max(self.run(ids) for ids in windows[:max_chunks])


@pytest.fixture(scope="module")
def ref(xlmr_reranker_path) -> Reference:
    return Reference(xlmr_reranker_path)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def scores_of(answer: dict) -> np.ndarray:
    return np.array([d["score"] for d in answer["data"]])


def by_index(results: list[dict], key: str = "relevance_score") -> np.ndarray:
    return np.array([r[key] for r in sorted(results, key=lambda r: r["index"])])


def close(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape == want.shape and float(np.abs(got - want).max()) <= TOLERANCE


# -- vLLM's /score -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "first,second", [("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
                     ("text_1", "text_2")],
)  # fmt: skip
def test_score_takes_every_vllm_spelling_with_its_pairing_rules(server, ref, first, second):
    docs = [SENTENCES[10], SENTENCES[11], SENTENCES[12]]
    one_to_n = post(server, "/score", {first: QUERY, second: docs})
    assert one_to_n.status_code == 200, one_to_n.text
    assert close(scores_of(one_to_n.json()), ref.pairs([QUERY] * 3, docs))
    queries = [QUERY, "What is a pipeline?", "Who keeps the plan?"]
    n_to_n = post(server, "/v1/score", {first: queries, second: docs}).json()
    assert close(scores_of(n_to_n), ref.pairs(queries, docs))
    one_to_one = post(server, "/score", {first: [queries[1]], second: [docs[1]]}).json()
    assert close(scores_of(one_to_one), ref.pairs([queries[1]], [docs[1]]))
    # vLLM: "Input lengths must be either 1:1, 1:N or N:N".
    r = post(server, "/score", {first: queries[:2], second: docs[0]})
    assert_error(r, 400, "invalid_request_error", param=first)


def test_score_refuses_mixed_or_missing_spellings(server):
    for body in ({"queries": "q", "text_2": "d"}, {"data_1": "q"}, {"queries": "q",
                 "documents": "d", "items": "d"}):  # fmt: skip
        assert_error(post(server, "/score", body), 400, "invalid_request_error", says="text_1")


def test_score_truncation_side_cuts_the_pair_from_the_asked_end(server, ref):
    docs = DOCUMENTS[:3]
    answers = {}
    for side in ("right", "left"):
        body = {"queries": QUERY, "documents": docs, "truncate_prompt_tokens": 24}
        answers[side] = scores_of(post(server, "/score", {**body, "truncation_side": side}).json())
        assert close(answers[side], ref.pairs([QUERY] * 3, docs, max_length=24, side=side))
    assert not close(answers["right"], answers["left"])
    default = post(server, "/score", {"queries": QUERY, "documents": docs,
                                      "truncate_prompt_tokens": 24}).json()  # fmt: skip
    assert close(scores_of(default), answers["right"])


def test_score_max_tokens_per_query_and_doc_cut_each_side_first(server, ref):
    query, doc = SENTENCES[3], SENTENCES[5]
    base = {"queries": query, "documents": doc}
    plain = scores_of(post(server, "/score", base).json())
    cut_q = scores_of(post(server, "/score", {**base, "max_tokens_per_query": 4}).json())
    cut_d = scores_of(post(server, "/score", {**base, "max_tokens_per_doc": 3}).json())
    assert close(cut_q, ref.pairs([ref.first_tokens(query, 4)], [doc]))
    assert close(cut_d, ref.pairs([query], [ref.first_tokens(doc, 3)]))
    assert not close(cut_q, plain) and not close(cut_d, plain)
    zero = {**base, "max_tokens_per_query": 0, "max_tokens_per_doc": 0}  # vLLM's 0: no cut
    assert close(scores_of(post(server, "/score", zero).json()), plain)


# -- /rerank: TEI's form --------------------------------------------------------------------------


def test_tei_truncate_and_truncation_direction_as_tei(server, ref):
    body = {"query": QUERY, "texts": DOCUMENTS}
    # The server refuses over-long pairs (--long-inputs error): TEI's truncate=false, and its
    # default (the server's auto-truncate), refuse them too.
    for flag in ({}, {"truncate": False}):
        r = post(server, "/rerank", {**body, **flag})
        assert_tei_error(r, 422, "Validation", "more than max_model_len")
    got = {}
    for direction in ("right", "Left"):
        r = post(server, "/rerank", {**body, "truncate": True, "truncation_direction": direction})
        assert r.status_code == 200, r.text
        got[direction] = by_index(r.json(), "score")
        side = direction.lower()
        want = ref.pairs([QUERY] * len(DOCUMENTS), DOCUMENTS, max_length=MAX_LEN, side=side)
        assert close(got[direction], want)
    assert not close(got["right"], got["Left"])


def test_tei_raw_scores_and_return_text(server, ref):
    body = {"query": QUERY, "texts": DOCUMENTS[3:]}
    plain = post(server, "/rerank", body).json()
    raw = post(server, "/rerank", {**body, "raw_scores": True, "return_text": True}).json()
    queries = [QUERY] * 2
    assert close(by_index(plain, "score"), ref.pairs(queries, DOCUMENTS[3:]))
    assert close(by_index(raw, "score"), ref.pairs(queries, DOCUMENTS[3:], activation=False))
    assert all("text" not in x for x in plain)
    assert [x["text"] for x in sorted(raw, key=lambda x: x["index"])] == DOCUMENTS[3:]


# -- /rerank: vLLM / Jina / Cohere ----------------------------------------------------------------


def test_rerank_truncation_side_top_n_and_return_documents(server, ref):
    body = {"query": QUERY, "documents": DOCUMENTS, "truncate_prompt_tokens": 32}
    got = {}
    for side in ("right", "left"):
        answer = post(server, "/v1/rerank", {**body, "truncation_side": side}).json()
        got[side] = by_index(answer["results"])
        want = ref.pairs([QUERY] * 5, DOCUMENTS, max_length=32, side=side)
        assert close(got[side], want)
        assert [r["document"] for r in answer["results"]] == [
            {"text": DOCUMENTS[r["index"]]} for r in answer["results"]
        ]
    assert not close(got["right"], got["left"])
    one = post(server, "/rerank", {"query": QUERY, "documents": DOCUMENTS[3]}).json()  # vLLM's
    assert [r["index"] for r in one["results"]] == [0]
    assert close(by_index(one["results"]), ref.pairs([QUERY], [DOCUMENTS[3]]))
    top = post(server, "/rerank", {**body, "top_n": 2, "return_documents": False}).json()
    order = np.argsort(-got["right"], kind="stable")[:2].tolist()
    assert [r["index"] for r in top["results"]] == order
    assert all("document" not in r for r in top["results"])


def test_rank_fields_rank_object_documents_by_the_named_fields(server, ref):
    documents = [
        {"title": SENTENCES[i], "body": SENTENCES[i + 5], "id": f"doc-{i}"} for i in range(3)
    ]
    got = {}
    for fields in (["title"], ["body"], ["body", "title"]):
        r = post(server, "/v1/rerank", {"query": QUERY, "documents": documents,
                                        "rank_fields": fields})  # fmt: skip
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        got[tuple(fields)] = by_index(results)
        texts = ["\n".join(f"{f}: {d[f]}" for f in fields) for d in documents]
        assert close(got[tuple(fields)], ref.pairs([QUERY] * 3, texts))
        # Cohere v1: the document comes back with all its fields.
        assert all(r["document"] == documents[r["index"]] for r in results)
    assert not close(got[("title",)], got[("body",)])
    assert not close(got[("body",)], got[("body", "title")])

    bad = {"query": QUERY, "documents": documents, "rank_fields": ["author"]}
    assert_error(post(server, "/rerank", bad), 400, "invalid_request_error", param="rank_fields")
    no_text = {"query": QUERY, "documents": documents}
    assert_error(post(server, "/rerank", no_text), 400, "invalid_request_error", param="documents")
    strings = {"query": QUERY, "documents": ["a"], "rank_fields": ["title"]}
    assert_error(
        post(server, "/rerank", strings), 400, "invalid_request_error", param="rank_fields"
    )


def test_cohere_v1_client_reranks_objects_by_rank_fields(server, ref):
    import cohere

    documents = [{"text": SENTENCES[i], "title": SENTENCES[i + 5]} for i in range(3)]
    client = cohere.Client(base_url=server.url, api_key="unused")
    response = client.rerank(
        query=QUERY, documents=documents, rank_fields=["title", "text"], return_documents=True
    )
    texts = [f"title: {d['title']}\ntext: {d['text']}" for d in documents]
    want = ref.pairs([QUERY] * 3, texts)
    got = {r.index: r.relevance_score for r in response.results}
    assert close(np.array([got[i] for i in range(3)]), want)
    assert all(r.document.text == documents[r.index]["text"] for r in response.results)


def test_max_chunks_per_doc_scores_a_long_document_by_its_best_chunk(server, ref):
    documents = DOCUMENTS[:3]
    got = {}
    for chunks in (1, 4):
        body = {"query": QUERY, "documents": documents, "max_chunks_per_doc": chunks}
        r = post(server, "/v1/rerank", body)
        assert r.status_code == 200, r.text  # long documents: chunked, not refused
        got[chunks] = by_index(r.json()["results"])
        want = np.array([ref.best_chunk(QUERY, d, chunks) for d in documents])
        assert close(got[chunks], want)
    assert not close(got[1], got[4])
    long_query = {"query": " ".join(SENTENCES), "documents": ["a"], "max_chunks_per_doc": 2}
    assert_error(post(server, "/rerank", long_query), 400, "invalid_request_error", param="query")


def test_cohere_v2_client_max_tokens_per_doc_and_priority(server, ref):
    import cohere

    client = cohere.ClientV2(base_url=server.url, api_key="unused")
    docs = DOCUMENTS[3:]
    response = client.rerank(
        model=MODEL, query=QUERY, documents=docs, max_tokens_per_doc=3, priority=0
    )
    got = {r.index: r.relevance_score for r in response.results}
    want = ref.pairs([QUERY] * 2, [ref.first_tokens(d, 3) for d in docs])
    assert close(np.array([got[0], got[1]]), want)
    assert not close(want, ref.pairs([QUERY] * 2, docs))
    with pytest.raises(cohere.errors.BadRequestError) as bad:
        client.rerank(model=MODEL, query=QUERY, documents=docs, priority=1)
    assert bad.value.body["error"]["param"] == "priority"


@pytest.mark.parametrize(
    "body,param",
    [
        ({"texts": ["a"], "return_documents": True}, "return_documents"),
        ({"texts": ["a"], "rank_fields": ["text"]}, "rank_fields"),
        ({"texts": ["a"], "request_id": "x"}, "request_id"),
        ({"documents": ["a"], "return_text": True}, "return_text"),
        ({"documents": ["a"], "raw_scores": True, "use_activation": True}, "raw_scores"),
        ({"texts": ["a"], "truncation_side": "left", "truncation_direction": "right"},
         "truncation_direction"),
        ({"texts": ["a"], "truncate": False, "truncate_prompt_tokens": 8}, "truncate"),
        ({"documents": ["a"], "max_chunks_per_doc": 0}, "max_chunks_per_doc"),
    ],
)  # fmt: skip
def test_rerank_refuses_contradicting_or_misplaced_fields_by_name(server, body, param):
    r = post(server, "/rerank", {"query": QUERY, **body})
    if "texts" in body:  # TEI's form: TEI's error body, which names the field in its message
        assert_tei_error(r, 422, "Validation", param)
    else:
        assert_error(r, 400, "invalid_request_error", param=param)


# -- vLLM's shared fields and /classify ------------------------------------------------------


def test_vllm_shared_fields_are_honoured_or_refused_by_name(server):
    base = {"queries": QUERY, "documents": ["a", "b"]}
    ok = {"user": "u-1", "priority": 0, "cache_salt": "s" * 43, "padding": "do_not_pad"}
    answer = post(server, "/score", {**base, **ok, "request_id": "abc"}).json()
    assert answer["id"] == "score-abc"
    assert post(server, "/score", base).json()["id"].startswith("score-")
    rerank = post(server, "/rerank", {"query": "q", "documents": ["a"], "request_id": "r1"})
    assert rerank.json()["id"] == "rerank-r1"
    for field, value in (("priority", 1), ("padding", "max_length"),
                         ("mm_processor_kwargs", {}), ("cache_salt", "")):  # fmt: skip
        r = post(server, "/score", {**base, field: value})
        assert_error(r, 400, "invalid_request_error", param=field)


def test_classify_truncation_side_keeps_the_asked_end(server, ref):
    texts = DOCUMENTS[:3]
    got = {}
    for side in ("right", "left"):
        body = {"input": texts, "truncate_prompt_tokens": 16, "truncation_side": side}
        answer = post(server, "/classify", {**body, "request_id": "c"}).json()
        assert answer["id"] == "classify-c"
        got[side] = np.array([d["probs"][0] for d in answer["data"]])
        assert close(got[side], ref.texts(texts, max_length=16, side=side))
    assert not close(got["right"], got["left"])
    r = post(server, "/classify", {"input": "a", "add_special_tokens": False})
    assert_error(r, 400, "invalid_request_error", param="add_special_tokens")


def test_classify_takes_this_models_token_ids_as_vllm_does(server, ref):
    ids = ref.tokenizer(DOCUMENTS[0])["input_ids"]
    by_text = post(server, "/classify", {"input": DOCUMENTS[0]}).json()
    by_ids = post(server, "/v1/classify", {"input": ids}).json()
    several = post(server, "/classify", {"input": [ids, ids[:10]]}).json()
    probs = [np.array([d["probs"][0] for d in a["data"]]) for a in (by_text, by_ids, several)]
    assert close(probs[1], probs[0]) and close(probs[0], np.array([ref.run(ids)]))
    assert close(probs[2], np.array([ref.run(ids), ref.run(ids[:10])]))
