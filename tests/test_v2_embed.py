"""Issue 33 part 5: Cohere v2's ``POST /v2/embed`` on a real ``pipepool serve`` (the official
cohere client unchanged): every embedding type is what sentence-transformers'
``quantize_embeddings`` makes of the float vectors, input types take the model's prompts as
``encode_query`` / ``encode_document`` do, truncation follows Cohere; and ``embed_dtype`` on
``/v1/embeddings`` sends float16 / bfloat16 as torch rounds them."""

from __future__ import annotations

import base64
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch
from sentence_transformers.util.quantization import quantize_embeddings as st_quantize
from test_server import ServerProcess
from test_server_limits import assert_error
from tiny_models import MIN_COSINE, SENTENCES, cosine
from tokenizers import Tokenizer

import pipepool
from pipepool.server.protocol import encode_array

MODEL = "all-MiniLM-L6-v2"
TEXTS = SENTENCES[:6]
TYPES = ["float", "int8", "uint8", "binary", "ubinary", "base64"]
LONG = " ".join(SENTENCES)  # far over MiniLM's 256 tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess([], tmp_path_factory.mktemp("v2-embed-log") / "server.log")
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
    tokenizer.no_padding()  # the file pads every batch to its longest
    tokenizer.no_truncation()
    return tokenizer


def embed(server: ServerProcess, **body) -> httpx.Response:
    body.setdefault("model", MODEL)
    body.setdefault("input_type", "search_document")
    return httpx.post(server.url + "/v2/embed", json=body, timeout=60)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def floats_of(answer: dict) -> np.ndarray:
    # JSON carries each float32 exactly: these are the server's vectors, bit for bit.
    return np.array(answer["embeddings"]["float"], dtype=np.float32)


def assert_close(got, expected) -> None:
    got, expected = np.asarray(got, dtype=np.float32), np.asarray(expected)
    assert got.shape == expected.shape
    assert cosine(got, expected).min() >= MIN_COSINE


# -- embedding types --------------------------------------------------------------------------


def test_every_type_is_quantize_embeddings_of_the_float_vectors(server, engine, tokenizer):
    answer = ok(embed(server, texts=TEXTS, embedding_types=TYPES))
    assert set(answer) == {"id", "embeddings", "texts", "meta", "response_type"}
    assert answer["response_type"] == "embeddings_by_type" and answer["texts"] == TEXTS
    assert set(answer["embeddings"]) == set(TYPES)
    tokens = sum(len(e.ids) for e in tokenizer.encode_batch(TEXTS))
    assert answer["meta"] == {
        "api_version": {"version": "2"},
        "billed_units": {"input_tokens": tokens},
    }
    floats = floats_of(answer)
    assert_close(floats, engine.embed(TEXTS))
    for precision in ("int8", "uint8", "binary", "ubinary"):
        got = np.array(answer["embeddings"][precision])
        want = st_quantize(floats, precision=precision)  # int8/uint8: this batch's ranges
        np.testing.assert_array_equal(got, want.astype(np.int64), err_msg=precision)
    assert np.array(answer["embeddings"]["binary"]).shape == (len(TEXTS), 384 // 8)
    decoded = [
        np.frombuffer(base64.b64decode(b), dtype="<f4") for b in answer["embeddings"]["base64"]
    ]
    np.testing.assert_array_equal(np.stack(decoded), floats)


@pytest.mark.parametrize("kind", TYPES)
def test_only_the_asked_type_appears(server, kind):
    answer = ok(embed(server, texts=TEXTS[:2], embedding_types=[kind]))
    assert list(answer["embeddings"]) == [kind]
    assert len(answer["embeddings"][kind]) == 2


def test_float_is_the_default_type(server):
    assert list(ok(embed(server, texts=TEXTS[:1]))["embeddings"]) == ["float"]


def test_given_ranges_are_the_int8_buckets(server, engine):
    calibration = engine.embed(SENTENCES[20:60])
    ranges = np.vstack((calibration.min(axis=0), calibration.max(axis=0))).astype(np.float64)
    answer = ok(
        embed(
            server, texts=TEXTS, embedding_types=["float", "int8", "uint8"], ranges=ranges.tolist()
        )
    )
    floats = floats_of(answer)
    for precision in ("int8", "uint8"):
        want = st_quantize(floats, precision=precision, ranges=ranges)
        np.testing.assert_array_equal(np.array(answer["embeddings"][precision]), want)
    # The same text gets the same integers whatever else is in the request.
    alone = ok(embed(server, texts=TEXTS[:1], embedding_types=["int8"], ranges=ranges.tolist()))
    np.testing.assert_array_equal(alone["embeddings"]["int8"][0], answer["embeddings"]["int8"][0])


def test_output_dimension_is_matryoshka(server, engine):
    answer = ok(
        embed(server, texts=TEXTS, embedding_types=["float", "ubinary"], output_dimension=16)
    )
    assert_close(answer["embeddings"]["float"], engine.embed(TEXTS, dimensions=16))
    want = st_quantize(floats_of(answer), precision="ubinary")
    np.testing.assert_array_equal(answer["embeddings"]["ubinary"], want)
    assert want.shape == (len(TEXTS), 2)


def test_python_quantize_embeddings_is_sentence_transformers(engine):
    vectors = engine.embed(SENTENCES[:40])
    ranges = np.vstack((vectors.min(axis=0) - 0.01, vectors.max(axis=0) + 0.01))
    for precision in ("float32", "int8", "uint8", "binary", "ubinary"):
        for given in (None, ranges):
            got = pipepool.quantize_embeddings(vectors, precision, ranges=given)
            want = st_quantize(vectors, precision=precision, ranges=given)
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
    with pytest.raises(pipepool.InvalidInputError, match="ranges must be"):
        pipepool.quantize_embeddings(vectors, "int8", ranges=ranges[:, :10])


# -- truncation -------------------------------------------------------------------------------


def test_truncate_end_and_start_cut_the_end_and_the_start(server, engine):
    end = ok(embed(server, texts=[LONG], truncate="END"))
    assert end["meta"]["billed_units"]["input_tokens"] == 256
    assert_close(floats_of(end), engine.embed([LONG], long_inputs="truncate"))
    assert ok(embed(server, texts=[LONG]))["embeddings"] == end["embeddings"]  # END: the default
    start = ok(embed(server, texts=[LONG], truncate="START"))
    assert start["meta"]["billed_units"]["input_tokens"] == 256
    want = engine.embed([LONG], long_inputs="truncate", truncation_side="left")
    assert_close(floats_of(start), want)
    assert cosine(floats_of(start), floats_of(end)).max() < 0.99  # not the same tokens


def test_truncate_none_refuses_long_texts(server):
    r = embed(server, texts=[TEXTS[0], LONG], truncate="NONE")
    assert_error(r, 400, "invalid_request_error", code="context_length_exceeded", says="input 1")


def test_max_tokens_cuts_each_text_or_refuses_it_with_none(server, engine):
    answer = ok(embed(server, texts=TEXTS[:2], max_tokens=5))
    assert answer["meta"]["billed_units"]["input_tokens"] == 10
    assert_close(floats_of(answer), engine.embed(TEXTS[:2], truncate_prompt_tokens=5))
    r = embed(server, texts=["hi", TEXTS[0]], max_tokens=5, truncate="NONE")
    assert_error(r, 400, "invalid_request_error", code="context_length_exceeded", param="texts")
    assert "texts 1 has" in r.json()["error"]["message"]
    assert ok(embed(server, texts=["hi"], max_tokens=5, truncate="NONE"))


# -- input types and prompts ------------------------------------------------------------------


@pytest.fixture(scope="module")
def st_server(st_bert_path, tmp_path_factory):
    """A folder with prompts: query "query: ", passage "passage: ", document "" (as
    sentence-transformers saves them)."""
    args = ["--model", str(st_bert_path), "--served-model-name", "st"]
    s = ServerProcess(args, tmp_path_factory.mktemp("v2-embed-st-log") / "server.log")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def test_input_types_take_the_prompts_sentence_transformers_would(st_server, st_bert_path):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(st_bert_path), device="cpu")
    expected = {
        "search_query": st.encode_query(TEXTS),
        "search_document": st.encode_document(TEXTS),
        "classification": st.encode(TEXTS),
        "clustering": st.encode(TEXTS),
    }
    for input_type, want in expected.items():
        answer = ok(embed(st_server, model="st", texts=TEXTS, input_type=input_type))
        assert_close(answer["embeddings"]["float"], want)
    query = ok(embed(st_server, model="st", texts=TEXTS, input_type="search_query"))
    plain = ok(embed(st_server, model="st", texts=TEXTS, input_type="classification"))
    assert cosine(floats_of(query), floats_of(plain)).max() < 0.999  # the prompt counts


def test_truncate_start_is_refused_where_a_prompt_comes_first(st_server):
    r = embed(st_server, model="st", texts=TEXTS, input_type="search_query", truncate="START")
    err = assert_error(r, 400, "invalid_request_error", param="truncate", says="START")
    assert "'query' prompt" in err["message"]
    # The document prompt is empty and classification has none: START cuts the text there.
    for input_type in ("search_document", "classification"):
        ok(embed(st_server, model="st", texts=[LONG], input_type=input_type, truncate="START"))


def test_classification_and_clustering_take_a_prompt_of_their_name():
    from pipepool.server.routes.cohere import _prompt_name

    prompts = {"query": "q: ", "passage": "p: ", "clustering": "c: "}
    engine = SimpleNamespace(inputs=SimpleNamespace(prompts=prompts))
    assert _prompt_name(engine, "search_query") == "query"
    assert _prompt_name(engine, "search_document") == "passage"
    assert _prompt_name(engine, "clustering") == "clustering"
    assert _prompt_name(engine, "classification") is None


# -- the cohere client ------------------------------------------------------------------------


def test_cohere_client_v2_embeds(server, engine):
    import cohere

    client = cohere.ClientV2(base_url=server.url, api_key="x")
    response = client.embed(
        model=MODEL, texts=TEXTS, input_type="search_query", embedding_types=TYPES
    )
    e = response.embeddings
    floats = np.array(e.float_, dtype=np.float32)
    assert_close(floats, engine.embed(TEXTS))
    np.testing.assert_array_equal(e.int8, st_quantize(floats, precision="int8"))
    np.testing.assert_array_equal(e.uint8, st_quantize(floats, precision="uint8"))
    np.testing.assert_array_equal(e.binary, st_quantize(floats, precision="binary"))
    np.testing.assert_array_equal(e.ubinary, st_quantize(floats, precision="ubinary"))
    assert [base64.b64decode(b) for b in e.base64] == [v.astype("<f4").tobytes() for v in floats]
    assert response.texts == TEXTS and response.response_type == "embeddings_by_type"
    assert response.meta.billed_units.input_tokens > 0

    with pytest.raises(cohere.errors.BadRequestError) as bad:
        client.embed(model=MODEL, texts=TEXTS, input_type="search_query", embedding_types=["int4"])
    assert bad.value.body["error"]["param"] == "embedding_types"
    with pytest.raises(cohere.errors.NotFoundError):
        client.embed(model="embed-v4.0", texts=TEXTS, input_type="search_query")


# -- errors, limits, metrics ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"embedding_types": ["int4"]}, "embedding_types", "'float', 'int8'"),
        ({"embedding_types": []}, "embedding_types", "at least one"),
        ({"texts": []}, "texts", "texts is empty"),
        ({"input_type": "image"}, "input_type", "'search_query'"),
        ({"truncate": "MIDDLE"}, "truncate", "'NONE'"),
        ({"images": ["data:image/png;base64,AA=="]}, "images", "text only"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"ranges": [[0.0, 1.0]]}, "ranges", "two rows"),
        ({"ranges": [[0.0], [1.0]], "embedding_types": ["int8"]}, "ranges", "[2, 384]"),
        ({"output_dimension": 1000}, "dimensions", "larger than"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(server, body, param, says):
    r = embed(server, **{"texts": TEXTS[:2], **body})
    assert_error(r, 400, "invalid_request_error", param=param, says=says)


def test_input_type_is_required_as_in_cohere_v2(server):
    r = httpx.post(server.url + "/v2/embed", json={"model": MODEL, "texts": ["a"]}, timeout=60)
    assert_error(r, 400, "invalid_request_error", param="input_type", says="Field required")


def test_limits_and_metrics_count_v2_embed(server):
    r = embed(server, texts=["a"] * 2049)
    assert_error(r, 400, "invalid_request_error", code="too_many_inputs", param="texts")
    assert "--max-inputs-per-request" in r.json()["error"]["message"]
    ok(embed(server, texts=["a"]))
    m = server.metrics()
    assert m['pipepool_http_requests_total{route="/v2/embed",status="200"}'] >= 1
    assert m['pipepool_http_requests_total{route="/v2/embed",status="400"}'] >= 1
    assert m['pipepool_http_errors_total{type="invalid_request_error",code="too_many_inputs"}'] >= 1


# -- embed_dtype on /v1/embeddings ------------------------------------------------------------


def openai_embed(server: ServerProcess, **body) -> list:
    r = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return [d["embedding"] for d in r.json()["data"]]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_embed_dtype_sends_what_torch_rounds_to(server, dtype):
    floats = torch.tensor(openai_embed(server, encoding_format="float"), dtype=torch.float32)
    narrow = floats.to(getattr(torch, dtype))
    sent = openai_embed(server, encoding_format="base64", embed_dtype=dtype)
    bits = np.stack([np.frombuffer(base64.b64decode(s), dtype="<i2") for s in sent])
    np.testing.assert_array_equal(bits, narrow.view(torch.int16).numpy())
    rounded = openai_embed(server, encoding_format="float", embed_dtype=dtype)
    np.testing.assert_array_equal(np.array(rounded, dtype=np.float32), narrow.float().numpy())
    default = openai_embed(server, encoding_format="base64", embed_dtype="float32")
    got = np.stack([np.frombuffer(base64.b64decode(s), dtype="<f4") for s in default])
    np.testing.assert_array_equal(got, floats.numpy())


def test_embed_dtype_rounds_to_nearest_even():
    # bfloat16 keeps 7 fraction bits: 1 + 2^-8 lies halfway between 1 (0x3F80) and 1 + 2^-7
    # (0x3F81), and goes to the even one; 1 + 3 * 2^-8 between 0x3F81 and 0x3F82: to 0x3F82.
    values = np.array([1 + 2**-8, 1 + 3 * 2**-8, -2.0], dtype=np.float32)
    bits = np.frombuffer(base64.b64decode(encode_array(values, "base64", "bfloat16")), "<u2")
    assert bits.tolist() == [0x3F80, 0x3F82, 0xC000]
    assert encode_array(values, "float", "bfloat16") == [1.0, 1 + 2**-6, -2.0]
    # float16 keeps 10: 1 + 2^-11 is halfway between 1 (0x3C00) and 1 + 2^-10 (0x3C01).
    halves = np.array([1 + 2**-11, 1 + 3 * 2**-11], dtype=np.float32)
    bits = np.frombuffer(base64.b64decode(encode_array(halves, "base64", "float16")), "<u2")
    assert bits.tolist() == [0x3C00, 0x3C02]


def test_embed_dtype_applies_to_pooling_and_is_checked(server):
    r = httpx.post(
        server.url + "/pooling",
        json={
            "input": "hello",
            "task": "token_embed",
            "encoding_format": "base64",
            "embed_dtype": "float16",
        },
    )
    assert r.status_code == 200, r.text
    assert len(base64.b64decode(r.json()["data"][0]["data"])) == 3 * 384 * 2  # [CLS] hello [SEP]
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "a", "embed_dtype": "fp8"})
    assert_error(r, 400, "invalid_request_error", param="embed_dtype")
