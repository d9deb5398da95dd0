"""Issue 37 items 1, 4 and 6 and issue 38 item 6, against a real ``pipepool serve`` with the
default limits (tiny Qwen3, max_model_len 128, served by its folder's path and no other name):
every route bounded (inputs, tokens, chunked tokens) with a 400 naming the limit and its flag;
/tokenize counts a text whole; a lone surrogate is a 400 on every route and the connection
serves on; booleans are strict; no server path in any answer; /version, /detokenize, latency
in the access log, TEI routes labelled in /metrics; the OpenAPI schema lists every status
each route answers."""

from __future__ import annotations

import re
import threading
from types import SimpleNamespace

import httpx
import pytest
from test_server import ServerProcess, _free_port, wait_for
from test_server_limits import assert_error
from test_tei_server import assert_tei_error
from tiny_models import SENTENCES
from tokenizers import Tokenizer

import pipepool
from pipepool.server.settings import ServerSettings

# Slow: real `pipepool serve` processes.
pytestmark = pytest.mark.slow

MAX_LEN = 128
DEFAULTS = ServerSettings()  # the limits this server runs with
MAX_CHUNKED = DEFAULTS.max_chunked_tokens
MAX_TOKENS = DEFAULTS.max_tokens_per_request
MAX_INPUTS = DEFAULTS.max_inputs_per_request
TEN_MB = 10_000_000


@pytest.fixture(scope="module")
def server(qwen3_path, tmp_path_factory):
    # The access log stays on (the default): its lines are checked below.
    args = ["--model", str(qwen3_path), "--max-model-len", str(MAX_LEN)]
    s = ServerProcess(args, tmp_path_factory.mktemp("hygiene-log") / "server.log")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def scorer(cross_encoder_path):
    """A cross-encoder's server with limits of its own (``SCORER``), set as ``pipepool serve``'s
    flags set them: in this process, on a real port, over real HTTP."""
    import uvicorn

    from pipepool.server.app import build_app
    from pipepool.server.front import AsyncEngine
    from pipepool.server.models import ServedModels
    from pipepool.server.owner import EngineOwner
    from pipepool.server.uvicorn_server import Server

    owner = EngineOwner(lambda: pipepool.Engine(str(cross_encoder_path), device="cpu"))
    owner.start(on_failure=lambda exc: None)
    owner.loaded.wait()
    front = AsyncEngine(owner, max_queued=64)
    models = ServedModels.one(front, ("scorer",))
    port = _free_port()
    config = uvicorn.Config(
        build_app(SCORER, models), port=port, log_config=None, access_log=False, lifespan="off"
    )
    started = threading.Event()
    server = Server(config, models, timeout_s=1.0, on_started=started.set)
    thread = threading.Thread(target=server.run, name="scorer-server")
    thread.start()
    try:
        assert started.wait(60), "the in-process server did not start"
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join()
        front.close()
        owner.close()


SCORER = ServerSettings(max_inputs_per_request=8, max_tokens_per_request=64)


@pytest.fixture(scope="module")
def tokenizer(qwen3_path) -> Tokenizer:
    return Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))


def post(server: ServerProcess, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120, **kwargs)


# -- limits ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "code", "flag"),
    [
        ({"inputs": "word " * (TEN_MB // 5)}, "context_length_exceeded", "--max-chunked-tokens"),
        ({"prompt": "word " * (TEN_MB // 5)}, "context_length_exceeded", "--max-chunked-tokens"),
        ({"inputs": ["word " * 1000] * 2000}, "too_many_tokens", "--max-tokens-per-request"),
    ],
    ids=["tei-one-text", "vllm-prompt", "tei-2000-texts"],
)
def test_a_10mb_tokenize_is_refused_naming_the_limit(server, body, code, flag):
    r = post(server, "/tokenize", body)
    if "inputs" in body:  # TEI's form: TEI's error
        assert_tei_error(r, 422, "Validation", flag)
    else:
        assert_error(r, 400, "invalid_request_error", code=code, says=flag)
    assert post(server, "/tokenize", {"inputs": "still here"}).status_code == 200


def test_a_100000_input_tokenize_is_refused_naming_the_limit(server):
    r = post(server, "/tokenize", {"inputs": ["a"] * 100_000})
    message = assert_tei_error(r, 413, "Validation", f"at most {MAX_INPUTS}")
    assert "--max-inputs-per-request" in message


def _text_of(tokenizer: Tokenizer, count: int) -> str:
    """A text the model's tokenizer (special tokens included) makes exactly ``count`` tokens:
    repeated words, from an estimate of tokens per word, and a tail to make up the rest."""

    def tokens(text: str) -> int:
        return len(tokenizer.encode(text).ids)

    per_word = (tokens("word " * 200) - tokens("word " * 100)) / 100
    start = max(0, int((count - tokens("")) / per_word) - 3)
    for words in range(start, start + 8):
        for tail in ("", "a", "wo", "word", " a", " wo"):
            text = "word " * words + tail
            if tokens(text) == count:
                return text
    raise AssertionError(f"no text of {count} tokens")


def test_tokenize_counts_a_2002_token_text_whole(server, tokenizer):
    text = _text_of(tokenizer, 2002)
    ids = tokenizer.encode(text).ids
    for field in ("prompt", "input"):
        r = post(server, "/tokenize", {field: text})
        assert r.status_code == 200, r.text
        assert r.json() == {"tokens": ids, "count": 2002, "max_model_len": MAX_LEN}
    r = post(server, "/tokenize", {"inputs": [text, "a"]})
    assert r.status_code == 200, r.text
    assert [len(tokens) for tokens in r.json()] == [2002, len(tokenizer.encode("a").ids)]
    assert [t["id"] for t in r.json()[0]] == ids


def test_chunk_beyond_the_server_maximum_is_refused_naming_the_limit(server, tokenizer):
    text = _text_of(tokenizer, MAX_CHUNKED + 1)
    for path in ("/v1/embeddings", "/pooling"):
        r = post(server, path, {"input": ["fine", text], "long_inputs": "chunk"})
        err = assert_error(r, 400, "invalid_request_error", "context_length_exceeded", "input")
        assert f"input 1 has {MAX_CHUNKED + 1} tokens" in err["message"]
        assert "--max-chunked-tokens" in err["message"]
    # Within it, a chunked input is embedded whole.
    long = _text_of(tokenizer, 3 * MAX_LEN + 5)
    r = post(server, "/v1/embeddings", {"input": long, "long_inputs": "chunk"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 3 * MAX_LEN + 5


def test_tokens_per_request_are_bounded(server, tokenizer):
    # Chunked inputs each within --max-chunked-tokens, together over --max-tokens-per-request.
    each = _text_of(tokenizer, MAX_CHUNKED)
    n = MAX_TOKENS // MAX_CHUNKED + 1
    r = post(server, "/v1/embeddings", {"input": [each] * n, "long_inputs": "chunk"})
    err = assert_error(r, 400, "invalid_request_error", "too_many_tokens", "input")
    assert f"at most {MAX_TOKENS} tokens per request" in err["message"]
    assert "--max-tokens-per-request" in err["message"]
    r = post(server, "/detokenize", {"tokens": [1] * (MAX_TOKENS + 1)})
    assert_error(r, 400, "invalid_request_error", "too_many_tokens", "tokens")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/rerank", {"query": "q", "documents": SENTENCES[:8]}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": SENTENCES[:8]}, "documents"),
        ("/score", {"text_1": SENTENCES[:8], "text_2": SENTENCES[8:16]}, "text_2"),
        ("/classify", {"input": SENTENCES[:8]}, "input"),
    ],
)
def test_scoring_routes_hold_to_the_configured_token_limit(scorer, path, body, param):
    """Pairs are counted once the engine has tokenised them, and cancelled if over."""
    r = httpx.post(scorer.url + path, json=body, timeout=60)
    err = assert_error(r, 400, "invalid_request_error", "too_many_tokens", param)
    limit = SCORER.max_tokens_per_request
    assert f"at most {limit} tokens per request (--max-tokens-per-request)" in err["message"]
    r = httpx.post(scorer.url + "/score", json={"text_1": "a", "text_2": "b"}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(scorer.url + path, json={**body, "truncate_prompt_tokens": 7}, timeout=60)
    assert r.status_code == 200, r.text  # 8 inputs of at most 7 tokens: bounded in advance
    r = httpx.post(scorer.url + "/classify", json={"input": ["a"] * 9}, timeout=60)
    assert_error(r, 400, "invalid_request_error", "too_many_inputs", "input", "at most 8")


def test_configured_limits_are_reported_by_info(scorer):
    limits = httpx.get(scorer.url + "/info").json()["limits"]
    assert limits["max_inputs_per_request"] == 8 and limits["max_tokens_per_request"] == 64
    assert limits["max_chunked_tokens"] == SCORER.max_chunked_tokens


# -- lone surrogates ------------------------------------------------------------------------

# (route, JSON body as sent, what the error names)
SURROGATES = [
    ("/v1/embeddings", r'{"input": ["fine", "bad \ud800 text"]}', "input 1"),
    ("/v1/embeddings", r'{"input": "a", "model": "m\ud800"}', "model"),
    # The bytes UTF-8 would give U+D800 (not valid UTF-8; Python's JSON parser takes them).
    ("/v1/embeddings", b'{"input": ["ok", "a\xed\xa0\x80"]}', "input 1"),
    ("/pooling", r'{"input": "\udfff"}', "input"),
    ("/tokenize", r'{"prompt": "x\ud800"}', "prompt"),
    ("/detokenize", r'{"tokens": [1], "model": "\ud800"}', "model"),
    ("/rerank", r'{"query": "q\ud800", "documents": ["a"]}', "query"),
    ("/v1/rerank", r'{"query": "q", "documents": ["a", {"text": "\ud800"}]}', "documents 1.text"),
    ("/v2/rerank", r'{"query": "q", "documents": ["\udc00"]}', "documents 0"),
    ("/score", r'{"text_1": "\ud800", "text_2": "b"}', "text_1"),
    ("/v1/score", r'{"text_1": "a", "text_2": ["b", "c\udc00"]}', "text_2 1"),
    ("/classify", r'{"input": ["\ud800"]}', "input 0"),
    ("/v1/classify", r'{"input": "a", "instruction\ud800": 1}', "a field name"),
    ("/v1/rerank", r'{"query": "q", "documents": [{"\udc00": 1}]}', "a field name in documents 0"),
]


JSON_BODY = {"Content-Type": "application/json"}


def test_lone_surrogate_in_a_tei_form_is_tei_422(server):
    for path, body, names in [
        ("/tokenize", r'{"inputs": ["x\udbff"]}', "inputs 0"),
        ("/rerank", r'{"query": "q", "texts": ["\udc00"]}', "texts 0"),
    ]:
        r = httpx.post(server.url + path, content=body.encode(), headers=JSON_BODY, timeout=30)
        assert assert_tei_error(r, 422, "Validation", "lone surrogate").startswith(
            f"{names} is not valid Unicode"
        )


@pytest.mark.parametrize(("path", "body", "names"), SURROGATES)
def test_lone_surrogate_is_400_on_every_route_and_the_connection_serves_on(
    server, path, body, names
):
    with httpx.Client(timeout=30, headers={"Content-Type": "application/json"}) as http:
        r = http.post(server.url + path, content=body if isinstance(body, bytes) else body.encode())
        err = assert_error(r, 400, "invalid_request_error", "invalid_value")
        assert err["message"].startswith(f"{names} is not valid Unicode"), err
        assert "lone surrogate" in err["message"]
        assert r.headers.get("connection") != "close"
        again = http.post(server.url + "/v1/embeddings", json={"input": "fine"})
        assert again.status_code == 200, again.text
    assert "Traceback" not in server.log()


def test_surrogate_pairs_are_one_character_and_pass(server):
    body = r'{"input": "smile \ud83d\ude00"}'
    r = httpx.post(
        server.url + "/v1/embeddings",
        content=body.encode(),
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 200, r.text


# -- schema ---------------------------------------------------------------------------------

NOT_BOOLEANS = [
    ("/v1/embeddings", {"input": "a", "normalize": 0}, "normalize"),
    ("/pooling", {"input": "a", "normalize": 1}, "normalize"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": 1}, "add_special_tokens"),
    ("/rerank", {"query": "q", "documents": ["a"], "return_documents": 0}, "return_documents"),
    ("/rerank", {"query": "q", "documents": ["a"], "raw_scores": "false"}, "raw_scores"),
    ("/rerank", {"query": "q", "documents": ["a"], "return_text": 1}, "return_text"),
    ("/score", {"text_1": "a", "text_2": "b", "use_activation": 0}, "use_activation"),
    ("/classify", {"input": "a", "activation": 1}, "activation"),
]


@pytest.mark.parametrize(("path", "body", "field"), NOT_BOOLEANS)
def test_booleans_are_strict(server, path, body, field):
    err = assert_error(post(server, path, body), 400, "invalid_request_error", "invalid_value")
    assert err["param"] == field and "boolean" in err["message"], err


def test_true_booleans_pass_validation(server):
    assert post(server, "/v1/embeddings", {"input": "a", "normalize": False}).status_code == 200
    # An embedding model cannot score: the 404 is about the model, not the boolean.
    r = post(server, "/score", {"text_1": "a", "text_2": "b", "use_activation": False})
    assert_error(r, 404, "invalid_request_error", param="model")


def test_no_server_path_in_any_answer(server, qwen3_path):
    path = str(qwen3_path)
    models = httpx.get(server.url + "/v1/models")
    assert [m["id"] for m in models.json()["data"]] == [qwen3_path.name]
    info = httpx.get(server.url + "/info")
    assert info.json()["served_model_names"] == [qwen3_path.name]
    assert info.json()["model_id"] == qwen3_path.name
    missing = post(server, "/v1/embeddings", {"input": "a", "model": "gpt-4"})
    err = assert_error(missing, 404, "invalid_request_error", "model_not_found", "model")
    assert qwen3_path.name in err["message"]
    unknown_route = httpx.get(server.url + "/v1/nothing")
    # The path stays accepted as a name (a vLLM server's default), answered by the served one.
    by_path = post(server, "/v1/embeddings", {"input": "a", "model": path})
    assert by_path.status_code == 200 and by_path.json()["model"] == qwen3_path.name
    for r in (models, info, missing, unknown_route, by_path):
        assert path not in r.text and str(qwen3_path.parent) not in r.text, r.text


def test_no_exception_text_in_an_internal_error():
    from pipepool.server.errors import from_engine

    err = from_engine(RuntimeError("cannot open /srv/secret/weights.bin"))
    assert err.status == 500 and "/srv/secret" not in err.message
    assert "RuntimeError" not in err.message and "server's log" in err.message


def test_an_engine_that_failed_to_start_is_503_without_its_cause():
    from pipepool.errors import EngineDeadError, ModelLoadError
    from pipepool.server.front import AsyncEngine
    from pipepool.server.owner import EngineOwner

    def fail():
        raise ModelLoadError("cannot load /srv/secret/tokenizer.json")

    owner = EngineOwner(fail)
    owner.start(on_failure=lambda exc: None)
    owner.loaded.wait()
    front = AsyncEngine(owner, max_queued=4)
    try:
        with pytest.raises(EngineDeadError) as failed:
            front.engine  # noqa: B018 (the property raises)
        assert "/srv/secret" not in str(failed.value) and "log" in str(failed.value)
    finally:
        front.close()
        owner.close()


# -- /version, /detokenize, the access log, metrics -----------------------------------------


def test_version(server):
    r = httpx.get(server.url + "/version")
    assert r.status_code == 200 and r.json() == {"version": pipepool.__version__}


def test_detokenize_round_trips_and_checks_the_ids(server, tokenizer):
    text = "The quick brown fox"
    ids = post(server, "/tokenize", {"prompt": text}).json()["tokens"]
    r = post(server, "/detokenize", {"tokens": ids, "model": "qwen3"})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
    assert r.json()["prompt"].startswith(text)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    for bad, says in (([1, vocab], f"tokens 1 is {vocab}"), ([-1], "tokens 0 is -1")):
        err = assert_error(
            post(server, "/detokenize", {"tokens": bad}), 400, "invalid_request_error",
            "invalid_value", "tokens", says,
        )  # fmt: skip
        assert f"[0, {vocab})" in err["message"]
    for bad in ([True], ["1"], "1 2", [1.5]):
        r = post(server, "/detokenize", {"tokens": bad})
        assert_error(r, 400, "invalid_request_error", param="tokens")
    r = post(server, "/detokenize", {"tokens": [1], "model": "gpt-4"})
    assert_error(r, 404, "invalid_request_error", "model_not_found", "model")


def test_access_log_lines_carry_the_latency(server):
    post(server, "/v1/embeddings", {"input": "logged"})
    line = re.compile(r'"POST /v1/embeddings HTTP/1\.1" 200 \d+\.\d ms')
    wait_for(lambda: line.search(server.log()), what="an access line with its latency")


def test_tei_and_tokenizer_routes_are_labelled_by_their_route_in_metrics(server):
    post(server, "/embed", {"inputs": "a"})
    httpx.get(server.url + "/info")
    post(server, "/tokenize", {"inputs": "a"})
    post(server, "/detokenize", {"tokens": [1]})
    httpx.get(server.url + "/version")
    m = server.metrics()
    for route in ("/embed", "/info", "/tokenize", "/detokenize", "/version"):
        assert m[f'pipepool_http_requests_total{{route="{route}",status="200"}}'] >= 1, route


# -- the schema (last: it checks the statuses every test above got) ---------------------------

MODEL_ROUTE = {"200", "400", "401", "404", "408", "413", "429", "500", "503"}
TOKENIZER_ROUTE = {"200", "400", "401", "404", "408", "413", "500", "503"}
READ_ROUTE = {"200", "401", "500"}
MODEL_ROUTES = ("/v1/embeddings", "/pooling")
MODEL_ROUTES += ("/score", "/v1/score", "/classify", "/v1/classify", "/v2/embed")
MODEL_ROUTES += ("/v1/embed",)
RERANK_ROUTES = ("/rerank", "/v1/rerank", "/v2/rerank")
# TEI's routes answer TEI's statuses (422 validation, 424 a task the model does not do).
TEI_MODEL_ROUTE = {"200", "400", "401", "408", "413", "422", "424", "429", "500", "503"}
TEI_MODEL_ROUTES = ("/", "/invocations", "/embed", "/embed_all", "/embed_sparse", "/predict")
TEI_MODEL_ROUTES += ("/similarity",)
ANSWERS = {
    **{(path, "post"): MODEL_ROUTE for path in MODEL_ROUTES},
    **{(path, "post"): TEI_MODEL_ROUTE for path in TEI_MODEL_ROUTES},
    ("/decode", "post"): TEI_MODEL_ROUTE - {"424", "429"},
    # TEI's form of a route other peers define too answers TEI's statuses as well.
    **{(path, "post"): MODEL_ROUTE | {"422", "424"} for path in RERANK_ROUTES},
    ("/tokenize", "post"): TOKENIZER_ROUTE | {"422"},
    ("/v1/tokenize", "post"): TOKENIZER_ROUTE,
    **{(path, "post"): TOKENIZER_ROUTE for path in ("/detokenize", "/v1/detokenize")},
    ("/v1/models", "get"): READ_ROUTE | {"400"},  # Cohere's filters and pages
    ("/v1/models/{model}", "get"): READ_ROUTE | {"404"},
    ("/info", "get"): READ_ROUTE,
    ("/version", "get"): READ_ROUTE,
    ("/health", "get"): {"200", "404", "500", "503"},  # 404: ?model= names no model
    ("/metrics", "get"): {"200", "500"},
    ("/v2/models/{model}/ready", "get"): {"200", "404", "500", "503"},
    # The Batch store's routes answer a storage fault 503, or 507 when its disk is full.
    ("/v1/files", "post"): {"200", "400", "401", "408", "413", "429", "500", "503", "507"},
    ("/v1/files", "get"): {"200", "400", "401", "500", "503", "507"},
    ("/v1/files/{file_id}", "get"): {"200", "401", "404", "500", "503", "507"},
    ("/v1/files/{file_id}", "delete"): {"200", "401", "404", "409", "500", "503", "507"},
    ("/v1/files/{file_id}/content", "get"): {"200", "401", "404", "500", "503", "507"},
    ("/v1/batches", "post"): {"200", "400", "401", "404", "408", "413", "500", "503", "507"},
    ("/v1/batches", "get"): {"200", "400", "401", "500", "503", "507"},
    ("/v1/batches/{batch_id}", "get"): {"200", "401", "404", "500", "503", "507"},
    ("/v1/batches/{batch_id}/cancel", "post"): {"200", "401", "404", "409", "500", "503", "507"},
}


def test_openapi_schema_documents_every_status_each_route_answers(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    documented = {
        (path, method): set(op["responses"])
        for path, operations in schema["paths"].items()
        for method, op in operations.items()
    }
    assert documented == ANSWERS
    assert "HTTPValidationError" not in schema.get("components", {}).get("schemas", {})
    # Every status this module's requests were answered is documented for its route.
    answered = re.compile(r'pipepool_http_requests_total\{route="([^"]+)",status="(\d+)"\}')
    by_route: dict[str, set[str]] = {}
    for (path, _method), codes in documented.items():
        by_route.setdefault(path, set()).update(codes)
    for key in server.metrics():
        found = answered.fullmatch(key)
        if found and found[1] in by_route:
            assert found[2] in by_route[found[1]], key
