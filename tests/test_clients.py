"""Issue 15 items 1, 3 and 8, against a real ``pipepool serve`` of the bundled model (the
README's server, started the README's way): every served name works, the README's client
recipes (openai, LangChain, LlamaIndex, chromadb) get the vectors sentence-transformers gives,
token ids are refused with the one setting LangChain users must change, and the TEI routes,
logs, docs and metrics behave."""

from __future__ import annotations

import json
import logging
import logging.config
import re
import subprocess
import sys

import httpx
import numpy as np
import openai
import pytest
from test_server import ServerProcess
from tiny_models import MIN_COSINE, SENTENCES, cosine

# Slow: real `pipepool serve` processes driven by the official clients.
pytestmark = pytest.mark.slow

TEXTS = SENTENCES[:4]
SHORT = "all-MiniLM-L6-v2"
HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess([], tmp_path_factory.mktemp("clients-log") / "server.log")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def expected(minilm_path) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path), device="cpu").encode(TEXTS)


def assert_vectors(got, expected) -> None:
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == expected.shape
    assert cosine(got, expected).min() >= MIN_COSINE


# -- names and start-up -----------------------------------------------------------------------


def test_readme_names_all_work_and_are_listed(server, expected):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    for name in (SHORT, HUB_ID):
        result = client.embeddings.create(model=name, input=TEXTS)
        assert result.model == name
        assert_vectors([d.embedding for d in result.data], expected)
    assert [m.id for m in client.models.list().data] == [HUB_ID, SHORT]
    with pytest.raises(openai.NotFoundError, match=SHORT):  # the 404 lists what is served
        client.embeddings.create(model="text-embedding-3-small", input="a")


def test_start_up_log_is_timestamped_and_names_models_and_url(server):
    log = server.log()
    ready = [line for line in log.splitlines() if "ready: model" in line]
    assert len(ready) == 1
    assert HUB_ID in ready[0] and SHORT in ready[0] and f"{server.url}/v1" in ready[0]
    stamp = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (INFO|DEBUG|WARNING|ERROR)")
    assert all(stamp.match(line) for line in log.splitlines() if line.strip()), log


def test_port_in_use_is_an_error_with_no_ready_line(server, bert_path):
    cmd = [sys.executable, "-m", "pipepool", "serve", "--model", str(bert_path)]
    r = subprocess.run([*cmd, "--port", str(server.port)], capture_output=True, text=True)
    assert r.returncode != 0
    assert "address already in use" in r.stderr.lower()
    assert "ready:" not in r.stderr and "engine ready" not in r.stderr, r.stderr


def test_json_log_format_is_one_object_per_line(capsys):
    from pipepool.server.logs import log_config

    logging.config.dictConfig(log_config("info", "json"))
    try:
        logging.getLogger("uvicorn.error").info("hello %s", "there")
        line = capsys.readouterr().err.strip().splitlines()[-1]
    finally:
        logging.config.dictConfig({"version": 1, "disable_existing_loggers": False})
        logging.getLogger().handlers.clear()
    entry = json.loads(line)
    assert entry["message"] == "hello there" and entry["logger"] == "uvicorn.error"
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", entry["time"])


# -- client recipes (README) ------------------------------------------------------------------


def test_openai_recipe(server, expected):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    result = client.embeddings.create(model=SHORT, input=TEXTS)
    assert_vectors([d.embedding for d in result.data], expected)


def test_langchain_recipe(server, expected):
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(
        model=SHORT, base_url=server.url + "/v1", api_key="unused", check_embedding_ctx_length=False
    )
    assert_vectors(embeddings.embed_documents(TEXTS), expected)
    assert_vectors([embeddings.embed_query(TEXTS[0])], expected[:1])


def test_langchain_default_settings_get_a_400_naming_the_setting(server, monkeypatch):
    """LangChain's default tokenises with OpenAI's tiktoken and sends the ids; they must not
    become vectors. (tiktoken's tables come from the internet: a stand-in gives ids.)"""
    import tiktoken
    from langchain_openai import OpenAIEmbeddings

    class FakeEncoding:
        def encode(self, text, **_):
            return [ord(c) % 1000 for c in text]

        encode_ordinary = encode

    monkeypatch.setattr(tiktoken, "encoding_for_model", lambda _: FakeEncoding())
    monkeypatch.setattr(tiktoken, "get_encoding", lambda _: FakeEncoding())
    embeddings = OpenAIEmbeddings(
        model=SHORT, base_url=server.url + "/v1", api_key="unused", max_retries=0
    )
    with pytest.raises(openai.BadRequestError, match="check_embedding_ctx_length=False"):
        embeddings.embed_documents(["hello", "world"])


def test_llama_index_recipe(server, expected):
    from llama_index.embeddings.openai import OpenAIEmbedding

    embedding = OpenAIEmbedding(model_name=SHORT, api_base=server.url + "/v1", api_key="unused")
    assert_vectors(embedding.get_text_embedding_batch(TEXTS), expected)


def test_chromadb_recipe(server, expected, monkeypatch):
    from chromadb.utils.embedding_functions import OpenAIEmbeddingFunction

    monkeypatch.setenv("CHROMA_OPENAI_API_KEY", "unused")
    function = OpenAIEmbeddingFunction(model_name=SHORT, api_base=server.url + "/v1")
    assert_vectors(function(TEXTS), expected)


def test_token_ids_are_refused_unless_allowed(server):
    r = httpx.post(server.url + "/v1/embeddings", json={"input": [[101, 7592, 102]]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "token_ids_not_allowed" and err["param"] == "input"
    assert "check_embedding_ctx_length=False" in err["message"]
    assert "--allow-token-ids" in err["message"]


def test_unknown_fields_are_refused_by_name(server):
    body = {"input": TEXTS[:1], "model": SHORT, "temperature": 0, "extra": {"x": 1}}
    r = httpx.post(server.url + "/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] == "Unrecognized request arguments supplied: temperature, extra"
    assert err["param"] == "temperature"


# -- TEI routes -------------------------------------------------------------------------------


def test_tei_embed_info_and_tokenize(server, expected, minilm_path):
    r = httpx.post(server.url + "/embed", json={"inputs": TEXTS})
    assert r.status_code == 200
    assert_vectors(r.json(), expected)
    r = httpx.post(server.url + "/embed", json={"inputs": TEXTS[0]})
    assert_vectors(r.json(), expected[:1])
    info = httpx.get(server.url + "/info").json()
    assert info["model_id"] == HUB_ID and info["max_input_length"] == 256
    assert info["model_type"] == {"embedding": {"pooling": "mean"}} and info["auto_truncate"]
    r = httpx.post(server.url + "/tokenize", json={"inputs": ["Hello world"]})
    tokens = r.json()[0]
    assert [t["text"] for t in tokens] == ["[CLS]", "Hello", "world", "[SEP]"]
    assert [t["special"] for t in tokens] == [True, False, False, True]
    assert (tokens[1]["start"], tokens[1]["stop"]) == (0, 5)


def test_long_inputs_truncate_by_default_with_usage_and_chunk_on_request(server):
    text = " ".join(SENTENCES)  # far over 256 tokens
    r = httpx.post(server.url + "/v1/embeddings", json={"input": text})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 256
    r = httpx.post(server.url + "/v1/embeddings", json={"input": text, "long_inputs": "chunk"})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 256
    r = httpx.post(server.url + "/v1/embeddings", json={"input": text, "long_inputs": "error"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_step_time_metric_is_device_time(server):
    m = server.metrics()
    assert m["pipepool_step_time_seconds_count"] == m["pipepool_steps_total"] > 0
    busy = m['pipepool_stage_busy_seconds_total{stage="0"}']
    assert busy > 0
    assert m["pipepool_step_time_seconds_sum"] == pytest.approx(busy, rel=1e-6, abs=1e-6)
