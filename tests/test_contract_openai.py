"""Issue 56, the OpenAI / vLLM side, against a real ``pipepool serve`` of the bundled model:
unknown fields are a 400 naming each; vLLM's ``truncation_side``, ``endianness`` and
``encoding_format`` "bytes" / "bytes_only" are honoured as vLLM defines them; ``/pooling``
runs vLLM's ``task`` (the model's own by default) and answers with ``id`` and ``created``;
``/tokenize`` takes ``return_token_strs`` and ``add_special_tokens: false`` in both its forms;
outputs a model does not give are a 400 naming those it gives."""

from __future__ import annotations

import base64
import json
import sys
import time
from typing import ClassVar

import httpx
import numpy as np
import pytest
import torch
from test_server import ServerProcess
from test_server_limits import assert_error
from test_tei_server import assert_tei_error
from tiny_models import MIN_COSINE, SENTENCES, cosine
from tokenizers import Tokenizer

import pipepool

TEXTS = SENTENCES[:3]
LONG = " ".join(SENTENCES)  # far over MiniLM's 256 tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess([], tmp_path_factory.mktemp("contract-log") / "server.log")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def engine(minilm_path):
    with pipepool.Engine(str(minilm_path)) as e:
        yield e


@pytest.fixture(scope="module")
def tokenizer(minilm_path) -> Tokenizer:
    tokenizer = Tokenizer.from_file(str(minilm_path / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def assert_close(got, expected) -> None:
    got, expected = np.asarray(got, dtype=np.float32), np.asarray(expected)
    assert got.shape == expected.shape
    assert cosine(got.reshape(-1, got.shape[-1]), expected.reshape(-1, got.shape[-1])).min() >= (
        MIN_COSINE
    )


# -- 1. unknown fields ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/embeddings", {"input": "a"}),
        ("/pooling", {"input": "a"}),
        ("/tokenize", {"prompt": "a"}),
        ("/detokenize", {"tokens": [101]}),
        ("/embed", {"inputs": "a"}),
        ("/v2/embed", {"texts": ["a"], "input_type": "search_query"}),
    ],
)
def test_unknown_fields_are_a_400_naming_every_one(server, path, body):
    """A field a peer has that pipepool does not honour (Jina's embedding_type), and a made-up
    one, are refused, never parsed and dropped; TEI's routes answer with TEI's status and body
    (422 Validation)."""
    r = post(server, path, {**body, "embedding_type": "float", "task_x": "retrieval"})
    says = "Unrecognized request arguments supplied: embedding_type, task_x"
    if path == "/embed":
        assert r.status_code == 422, r.text
        assert r.json() == {"error": says, "error_type": "Validation"}
        return
    err = assert_error(r, 400, "invalid_request_error", param="embedding_type")
    assert err["message"] == says


# -- 2. truncation_side -----------------------------------------------------------------------


def test_truncation_side_cuts_the_end_vllm_names(server, engine):
    got = {}
    for side in ("left", "right"):
        body = {"input": [LONG], "truncate_prompt_tokens": 12, "truncation_side": side}
        answer = ok(post(server, "/v1/embeddings", body))
        assert answer["usage"]["prompt_tokens"] == 12
        got[side] = np.array(answer["data"][0]["embedding"])
        want = engine.embed([LONG], truncate_prompt_tokens=12, truncation_side=side)
        assert_close(got[side], want[0])
        # /pooling's embed task and its token vectors cut the same end
        pooled = ok(post(server, "/pooling", {**body, "task": "embed"}))["data"][0]["data"]
        assert_close(pooled, want[0])
        tokens = ok(post(server, "/pooling", {**body, "task": "token_embed"}))["data"][0]
        want_tokens = engine.embed_tokens([LONG], truncate_prompt_tokens=12, truncation_side=side)
        assert_close(tokens["data"], want_tokens[0])
    assert cosine(got["left"][None], got["right"][None])[0] < 0.9  # two different texts


def test_truncation_side_applies_where_the_server_truncates_at_max_model_len(server, engine):
    body = {"input": LONG, "long_inputs": "truncate", "truncation_side": "left"}
    got = ok(post(server, "/v1/embeddings", body))["data"][0]["embedding"]
    assert_close(got, engine.embed([LONG], long_inputs="truncate", truncation_side="left")[0])


def test_use_activation_is_vllm_s_name_for_normalize(server):
    raw = _floats(server, normalize=False)
    np.testing.assert_array_equal(_floats(server, use_activation=False), raw)
    np.testing.assert_array_equal(_floats(server, "/pooling", use_activation=False), raw)
    assert not np.allclose(np.linalg.norm(raw[0]), 1.0)
    r = post(server, "/v1/embeddings", {"input": "a", "normalize": True, "use_activation": False})
    assert_error(r, 400, "invalid_request_error", says="disagree")


def test_truncation_side_is_one_of_vllm_s_two(server):
    r = post(server, "/v1/embeddings", {"input": "a", "truncation_side": "middle"})
    assert_error(r, 400, "invalid_request_error", param="truncation_side")


# -- vLLM's add_special_tokens ----------------------------------------------------------------


def test_add_special_tokens_false_embeds_the_text_s_own_tokens(server, engine, tokenizer):
    plain = [tokenizer.encode(t, add_special_tokens=False).ids for t in TEXTS]
    body = {"input": TEXTS, "add_special_tokens": False}
    answer = ok(post(server, "/v1/embeddings", body))
    assert answer["usage"]["prompt_tokens"] == sum(map(len, plain))
    want = engine.embed(plain)
    for d, w, default in zip(answer["data"], want, _floats(server), strict=True):
        assert_close(d["embedding"], w)
        assert cosine(np.array(d["embedding"])[None], default[None])[0] < 0.999
    tokens = ok(post(server, "/pooling", {**body, "task": "token_embed"}))["data"]
    for d, ids, w in zip(tokens, plain, engine.embed_tokens(plain), strict=True):
        assert np.array(d["data"]).shape == (len(ids), 384)
        assert_close(d["data"], w)
    r = post(server, "/v1/embeddings", {"input": ["fine", ""], "add_special_tokens": False})
    assert_error(r, 400, "invalid_request_error", param="input", says="input 1")


# -- 3. endianness and bytes ------------------------------------------------------------------


def _floats(server, path: str = "/v1/embeddings", **body) -> list[np.ndarray]:
    answer = ok(post(server, path, {"input": TEXTS, "encoding_format": "float", **body}))
    field = "embedding" if path == "/v1/embeddings" else "data"
    return [np.array(d[field], dtype=np.float32) for d in answer["data"]]


def _decode(data: bytes, dtype: str, order: str) -> np.ndarray:
    """Values of ``embed_dtype`` ``dtype`` from bytes in byte order ``order`` ("<" or ">")."""
    if dtype.startswith("fp8"):  # one byte each: no order; numpy has no fp8
        fp8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[dtype]
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(fp8).float().numpy()
    if dtype == "bfloat16":  # the high half of a float32
        bits = np.frombuffer(data, dtype=order + "u2").astype(np.uint32) << 16
        return bits.view(np.float32)
    return np.frombuffer(data, dtype=order + {"float32": "f4", "float16": "f2"}[dtype])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"])
def test_base64_is_written_in_the_endianness_asked_for(server, dtype):
    want = _floats(server, embed_dtype=dtype)  # the values rounded through dtype
    native = "<" if sys.byteorder == "little" else ">"
    for endianness, order in (("little", "<"), ("big", ">"), ("native", native)):
        body = {"input": TEXTS, "encoding_format": "base64", "embed_dtype": dtype}
        answer = ok(post(server, "/v1/embeddings", {**body, "endianness": endianness}))
        for d, w in zip(answer["data"], want, strict=True):
            got = _decode(base64.b64decode(d["embedding"]), dtype, order)
            np.testing.assert_array_equal(got.astype(np.float32), w)
    # float's values are the exact ones rounded through dtype, to nearest even (torch's rule)
    torch_dtype = {
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "fp8_e4m3": torch.float8_e4m3fn,
        "fp8_e5m2": torch.float8_e5m2,
    }[dtype]
    for d, w in zip(want, _floats(server), strict=True):
        np.testing.assert_array_equal(d, torch.from_numpy(w).to(torch_dtype).float().numpy())


def test_bytes_are_vllm_s_binary_answer(server):
    want = _floats(server)
    before = int(time.time())
    r = post(
        server, "/v1/embeddings", {"input": TEXTS, "encoding_format": "bytes", "endianness": "big"}
    )
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    meta = json.loads(r.headers["metadata"])
    assert meta["id"].startswith("embd-") and before <= meta["created"] <= time.time() + 1
    assert meta["model"] == "sentence-transformers/all-MiniLM-L6-v2"
    tokens = ok(post(server, "/v1/embeddings", {"input": TEXTS}))["usage"]
    assert meta["usage"] == tokens
    assert [item["index"] for item in meta["data"]] == [0, 1, 2]
    assert meta["data"][-1]["end"] == len(r.content)
    for item, w in zip(meta["data"], want, strict=True):
        assert (item["embed_dtype"], item["endianness"], item["shape"]) == ("float32", "big", [384])
        got = np.frombuffer(r.content[item["start"] : item["end"]], dtype=">f4")
        np.testing.assert_array_equal(got, w)
    only = post(server, "/v1/embeddings", {"input": TEXTS, "encoding_format": "bytes_only"})
    assert only.status_code == 200 and "metadata" not in only.headers
    assert only.content == np.concatenate(want).astype("=f4").tobytes()


def test_bytes_of_token_vectors_carry_each_matrix_shape(server):
    body = {"input": TEXTS, "task": "token_embed"}
    want = [
        np.array(d["data"], dtype=np.float32) for d in ok(post(server, "/pooling", body))["data"]
    ]
    r = post(server, "/pooling", {**body, "encoding_format": "bytes", "embed_dtype": "float16"})
    meta = json.loads(r.headers["metadata"])
    assert meta["id"].startswith("pooling-")
    for item, w in zip(meta["data"], want, strict=True):
        assert item["shape"] == list(w.shape)
        got = np.frombuffer(r.content[item["start"] : item["end"]], dtype="=f2")
        np.testing.assert_array_equal(got.reshape(w.shape), w.astype(np.float16))


def test_bytes_carry_dense_vectors_only(server):
    r = post(
        server, "/v1/embeddings", {"input": "a", "outputs": ["dense"], "encoding_format": "bytes"}
    )
    assert r.status_code == 200 and len(r.content) == 384 * 4


# -- 4. /pooling's task -----------------------------------------------------------------------


def test_pooling_without_task_is_the_model_s_task_embed(server):
    """vLLM: a request without task gets the model's own (an embedding model's: embed), one
    vector per input, as /v1/embeddings gives it; the answer has vLLM's id and created."""
    want = _floats(server)
    before = int(time.time())
    answer = ok(post(server, "/pooling", {"input": TEXTS}))
    assert answer["id"].startswith("pooling-") and before <= answer["created"] <= time.time() + 1
    assert (
        answer["object"] == "list" and answer["model"] == "sentence-transformers/all-MiniLM-L6-v2"
    )
    for i, (d, w) in enumerate(zip(answer["data"], want, strict=True)):
        assert d["object"] == "pooling" and d["index"] == i
        np.testing.assert_array_equal(np.array(d["data"], dtype=np.float32), w)
    assert (
        ok(post(server, "/pooling", {"input": TEXTS, "task": "embed"}))["data"] == (answer["data"])
    )
    assert answer["id"] != ok(post(server, "/pooling", {"input": TEXTS}))["id"]


def test_pooling_token_embed_is_one_vector_per_token(server, engine, tokenizer):
    answer = ok(post(server, "/pooling", {"input": TEXTS, "task": "token_embed"}))
    for d, text, want in zip(answer["data"], TEXTS, engine.embed_tokens(TEXTS), strict=True):
        assert np.array(d["data"]).shape == (len(tokenizer.encode(text).ids), 384)
        assert_close(d["data"], want)


@pytest.mark.parametrize(
    "task", ["classify", "token_classify", "plugin", "embed&token_classify", "encode", ""]
)
def test_a_task_the_model_does_not_do_is_a_400_naming_its_tasks(server, task):
    r = post(server, "/pooling", {"input": "a", "task": task})
    err = assert_error(r, 400, "invalid_request_error", code="unsupported_task", param="task")
    assert f"task {task} is not one" in err["message"]
    assert err["message"].endswith("its tasks: embed, token_embed")


def test_pooling_takes_no_field_of_embeddings_it_does_not_honour(server):
    r = post(server, "/pooling", {"input": "a", "dimensions": 8})
    assert_error(r, 400, "invalid_request_error", param="dimensions")


# -- 5. /tokenize -----------------------------------------------------------------------------


def test_tokenize_returns_token_strings_and_leaves_special_tokens_out(server, tokenizer):
    text = "Tokenizers split words"
    encoding = tokenizer.encode(text)
    answer = ok(post(server, "/tokenize", {"prompt": text, "return_token_strs": True}))
    assert answer["tokens"] == encoding.ids and answer["token_strs"] == encoding.tokens
    plain = tokenizer.encode(text, add_special_tokens=False)
    for field in ("prompt", "input"):
        body = {field: text, "add_special_tokens": False, "return_token_strs": True}
        answer = ok(post(server, "/tokenize", body))
        assert answer["tokens"] == plain.ids and answer["count"] == len(plain.ids)
        assert answer["token_strs"] == plain.tokens
    assert "token_strs" not in ok(post(server, "/tokenize", {"prompt": text}))


def test_tei_tokenize_leaves_special_tokens_out(server, tokenizer):
    texts = ["Hello world", "Tokenizers split words"]
    answer = ok(post(server, "/tokenize", {"inputs": texts, "add_special_tokens": False}))
    for text, tokens in zip(texts, answer, strict=True):
        plain = tokenizer.encode(text, add_special_tokens=False)
        assert [t["id"] for t in tokens] == plain.ids
        assert not any(t["special"] for t in tokens)
        assert [text[t["start"] : t["stop"]] for t in tokens] == [
            text[a:b] for a, b in plain.offsets
        ]
    with_specials = ok(post(server, "/tokenize", {"inputs": texts}))
    assert [t["special"] for t in with_specials[0]] == [True, False, False, True]
    r = post(server, "/tokenize", {"inputs": texts, "return_token_strs": True})
    assert_tei_error(r, 422, "Validation", "return_token_strs")  # TEI's form: TEI's error


# -- 6. outputs a model does not give ---------------------------------------------------------


def test_sparse_outputs_of_a_dense_model_are_a_400_naming_what_it_gives(server):
    r = post(server, "/v1/embeddings", {"input": "a", "outputs": ["sparse", "multi_vector"]})
    err = assert_error(r, 400, "invalid_request_error", code="unsupported_output", param="outputs")
    assert "does not give sparse, multi_vector outputs; it gives dense" in err["message"]


def test_a_batch_line_asking_for_bytes_is_refused_naming_the_field():
    """A batch output line is JSON: vLLM's bytes answer cannot be one (base64 can)."""
    from pipepool.jobs.batch_lines import LineChecker, LineError

    checker = LineChecker("/v1/embeddings")
    for fmt in ("bytes", "bytes_only"):
        body = {"input": "a", "encoding_format": fmt}
        line = {"custom_id": fmt, "method": "POST", "url": "/v1/embeddings", "body": body}
        checked = checker.check(1, json.dumps(line).encode())
        assert isinstance(checked, LineError), checked
        assert (checked.code, checked.param) == ("invalid_value", "body.encoding_format")
        assert f"encoding_format {fmt}" in checked.message and "base64" in checked.message
    line = {"custom_id": "b64", "method": "POST", "url": "/v1/embeddings", "body": {"input": "a"}}
    line["body"]["encoding_format"] = "base64"
    assert not isinstance(checker.check(2, json.dumps(line).encode()), LineError)


def test_a_family_s_tolerated_fields_are_set_aside_and_no_other():
    """The one exception a route family may state: a named field it takes without acting on
    it, with the reason; every other unknown field stays a validation error."""
    from pydantic import ValidationError

    from pipepool.server.strict import StrictRequest

    class Family(StrictRequest):
        tolerated: ClassVar[dict[str, str]] = {
            "client_hint": "a client's own bookkeeping; it changes no answer"
        }
        text: str

    assert Family.model_validate({"text": "a", "client_hint": 3}).model_dump() == {"text": "a"}
    with pytest.raises(ValidationError) as caught:
        Family.model_validate({"text": "a", "client_hint": 3, "other": 1})
    assert [(e["type"], e["loc"]) for e in caught.value.errors()] == [
        ("extra_forbidden", ("other",))
    ]
