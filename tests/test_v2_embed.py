"""Issue 33 part 5 and issue 56: Cohere's ``POST /v2/embed`` and v1's ``/v1/embed``,
``/v1/tokenize`` and ``/v1/detokenize`` on a real ``pipepool serve`` (the official cohere v1
and v2 clients unchanged): int8/uint8 are the model's fixed symmetric scale
(``api/int8_scale.py``: a text's integers the same in any request, close to its floats),
binary/ubinary what sentence-transformers' ``quantize_embeddings`` makes of the float vectors,
input types take the model's prompts as ``encode_query`` / ``encode_document`` do, truncation
follows Cohere; and ``embed_dtype`` on ``/v1/embeddings`` sends float16 / bfloat16 as torch
rounds them."""

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
from pipepool.api.quantization import quantize_symmetric
from pipepool.server.protocol import encode_array

# Slow: real `pipepool serve` processes.
pytestmark = pytest.mark.slow

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


def test_every_type_is_its_rule_applied_to_the_float_vectors(server, engine, tokenizer):
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
    # int8/uint8: the model's bound, computed here by another engine on the same model.
    for precision in ("int8", "uint8"):
        want = quantize_symmetric(floats, precision, engine.int8_bound())
        np.testing.assert_array_equal(answer["embeddings"][precision], want, err_msg=precision)
    for precision in ("binary", "ubinary"):
        got = np.array(answer["embeddings"][precision])
        want = st_quantize(floats, precision=precision)
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


def test_one_texts_int8_is_not_constant_and_approximates_its_floats(server):
    answer = ok(embed(server, texts=TEXTS[:1], embedding_types=["float", "int8", "uint8"]))
    floats = floats_of(answer)
    int8 = np.array(answer["embeddings"]["int8"], dtype=np.float64)
    uint8 = np.array(answer["embeddings"]["uint8"], dtype=np.float64) - 128
    assert len(np.unique(int8)) > 20  # per-request ranges made one text a constant -128
    assert cosine(int8, floats).min() >= 0.99
    assert cosine(uint8, floats).min() >= 0.99


def test_int8_and_uint8_approximate_the_floats_of_every_text(server):
    answer = ok(embed(server, texts=SENTENCES, embedding_types=["float", "int8", "uint8"]))
    floats = floats_of(answer)
    int8 = np.array(answer["embeddings"]["int8"], dtype=np.float64)
    uint8 = np.array(answer["embeddings"]["uint8"], dtype=np.float64) - 128
    assert cosine(int8, floats).min() >= 0.99
    assert cosine(uint8, floats).min() >= 0.99
    np.testing.assert_array_equal(uint8, int8)


def test_a_texts_int8_is_the_same_alone_and_among_other_texts(server):
    types = ["int8", "uint8"]
    together = ok(embed(server, texts=TEXTS, embedding_types=types))["embeddings"]
    for i, text in enumerate(TEXTS):
        alone = ok(embed(server, texts=[text], embedding_types=types))["embeddings"]
        assert alone["int8"][0] == together["int8"][i], i
        assert alone["uint8"][0] == together["uint8"][i], i
    others = SENTENCES[30:40] + TEXTS[::-1]
    mixed = ok(embed(server, texts=others, embedding_types=["int8"]))["embeddings"]["int8"]
    assert mixed[10:][::-1] == together["int8"]


def test_output_dimension_has_its_own_int8_bound(server, engine):
    answer = ok(embed(server, texts=TEXTS, embedding_types=["float", "int8"], output_dimension=32))
    floats = floats_of(answer)
    bound = engine.int8_bound(32)
    assert bound > engine.int8_bound()  # 32 unit-length components are larger than 384
    np.testing.assert_array_equal(
        answer["embeddings"]["int8"], quantize_symmetric(floats, "int8", bound)
    )
    assert cosine(np.array(answer["embeddings"]["int8"], np.float64), floats).min() >= 0.99


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
    engine = SimpleNamespace(info=SimpleNamespace(prompts=prompts))
    assert _prompt_name(engine, "search_query") == "query"
    assert _prompt_name(engine, "search_document") == "passage"
    assert _prompt_name(engine, "clustering") == "clustering"
    assert _prompt_name(engine, "classification") is None


# -- the cohere client ------------------------------------------------------------------------


def test_cohere_client_v2_embeds(server, engine):
    import cohere

    client = cohere.ClientV2(base_url=server.url, api_key="x")
    response = client.embed(
        model=MODEL, texts=TEXTS, input_type="search_query", embedding_types=TYPES, priority=0
    )
    e = response.embeddings
    floats = np.array(e.float_, dtype=np.float32)
    assert_close(floats, engine.embed(TEXTS))
    np.testing.assert_array_equal(e.int8, quantize_symmetric(floats, "int8", engine.int8_bound()))
    np.testing.assert_array_equal(e.uint8, np.array(e.int8) + 128)
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
        ({"input_type": "image"}, "input_type", "input_type image goes with images"),
        ({"truncate": "MIDDLE"}, "truncate", "'NONE'"),
        ({"images": ["data:image/png;base64,AA=="]}, "images", "not both"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"ranges": [[0.0, 1.0]]}, "ranges", "two rows"),
        ({"ranges": [[0.0], [1.0]], "embedding_types": ["int8"]}, "ranges", "[2, 384]"),
        ({"output_dimension": 1000}, "dimensions", "larger than"),
        ({"ranges": [[0.0], [1.0]], "embedding_types": ["float"]}, "ranges", "int8 or uint8"),
        ({"priority": 3}, "priority", "no other levels"),
        (
            {"inputs": [{"content": [{"type": "text", "text": "x"}]}]},
            "inputs",
            "send texts, images or inputs",
        ),
        ({"texts": None, "inputs": [{"content": []}]}, "inputs", "at least 1 item"),
        (
            {"texts": None, "inputs": [{"content": [{"type": "text", "text": "x"}]}]},
            "inputs",
            "need a vision-language embedder",
        ),
    ],
)
def test_bad_requests_are_400s_naming_the_field(server, body, param, says):
    full = {"texts": TEXTS[:2], **body}
    r = embed(server, **{k: v for k, v in full.items() if v is not None})
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


# -- Cohere v1: /v1/embed, /v1/tokenize, /v1/detokenize ----------------------------------------


def post(server: ServerProcess, path: str, **body) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_v1_embed_answers_floats_without_embedding_types(server, engine, tokenizer):
    answer = ok(post(server, "/v1/embed", model=MODEL, texts=TEXTS))  # input_type optional in v1
    assert set(answer) == {"id", "embeddings", "texts", "meta", "response_type"}
    assert answer["response_type"] == "embeddings_floats" and answer["texts"] == TEXTS
    tokens = sum(len(e.ids) for e in tokenizer.encode_batch(TEXTS))
    assert answer["meta"] == {
        "api_version": {"version": "1"},
        "billed_units": {"input_tokens": tokens},
    }
    assert_close(answer["embeddings"], engine.embed(TEXTS))


def test_v1_embed_by_type_is_v2s_answer(server):
    body = {"texts": TEXTS, "embedding_types": TYPES, "input_type": "search_document"}
    v1 = ok(post(server, "/v1/embed", **body))
    v2 = ok(embed(server, **body))
    assert v1["response_type"] == "embeddings_by_type"
    assert v1["embeddings"] == v2["embeddings"] and v1["meta"]["api_version"]["version"] == "1"


def test_v1_input_type_takes_the_prompt_v2_takes(st_server):
    for input_type in ("search_query", "search_document"):
        body = {"model": "st", "texts": TEXTS, "input_type": input_type}
        v1 = ok(post(st_server, "/v1/embed", **body))["embeddings"]
        assert v1 == ok(embed(st_server, **body))["embeddings"]["float"]


def test_v1_tokenize_gives_the_tokens_and_their_pieces(server, tokenizer):
    text = "Tokenize me! :D  Ünïcödé 东京"
    answer = ok(post(server, "/v1/tokenize", model=MODEL, text=text))
    assert set(answer) == {"tokens", "token_strings", "meta"}
    assert answer["tokens"] == tokenizer.encode(text, add_special_tokens=False).ids
    pieces = answer["token_strings"]
    assert pieces[:4] == ["Token", "ize", " me", "!"]  # spaces go with the word after them
    assert "".join(pieces) == text and len(pieces) == len(answer["tokens"])
    assert answer["meta"] == {"api_version": {"version": "1"}}
    back = ok(post(server, "/v1/detokenize", model=MODEL, tokens=answer["tokens"]))
    assert back == {"text": tokenizer.decode(answer["tokens"]), "meta": answer["meta"]}
    specials = [101, *answer["tokens"][:2], 102]  # [CLS] ... [SEP]: left out, as Cohere's client
    assert ok(post(server, "/v1/detokenize", tokens=specials))["text"] == "tokenize"


def test_cohere_client_v1_embeds_tokenizes_and_detokenizes(server, engine, tokenizer):
    import cohere

    client = cohere.Client(base_url=server.url, api_key="x")
    floats = client.embed(model=MODEL, texts=TEXTS, input_type="search_query")
    assert floats.response_type == "embeddings_floats" and floats.texts == TEXTS
    assert_close(floats.embeddings, engine.embed(TEXTS))
    # 100 texts: the client sends 96 and 4 and joins the answers; the integers of a text do
    # not depend on which request carried it.
    texts = [f"{i}: {SENTENCES[i % len(SENTENCES)]}" for i in range(100)]
    by_type = client.embed(model=MODEL, texts=texts, embedding_types=["int8", "float"])
    assert by_type.response_type == "embeddings_by_type" and by_type.texts == texts
    whole = ok(post(server, "/v1/embed", model=MODEL, texts=texts, embedding_types=["int8"]))
    assert by_type.embeddings.int8 == whole["embeddings"]["int8"]
    assert by_type.meta.billed_units.input_tokens > 0

    text = "Tokenize me! :D"
    tokens = client.tokenize(text=text, model=MODEL)  # no tokenizer file here: asks the server
    assert tokens.tokens == tokenizer.encode(text, add_special_tokens=False).ids
    assert tokens.token_strings == ["Token", "ize", " me", "!", " :", "D"]
    assert client.detokenize(tokens=tokens.tokens, model=MODEL).text == "tokenize me! : d"

    with pytest.raises(cohere.errors.BadRequestError) as bad:
        client.embed(model=MODEL, texts=TEXTS, embedding_types=["int4"])
    assert bad.value.body["error"]["param"] == "embedding_types"
    with pytest.raises(cohere.errors.NotFoundError):
        client.embed(model="embed-english-v3.0", texts=TEXTS)


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        ("/v1/embed", {"texts": []}, "texts", "texts is empty"),
        ("/v1/embed", {"texts": ["a"], "embedding_types": []}, "embedding_types", "at least one"),
        ("/v1/embed", {"texts": ["a"], "input_type": "image"}, "input_type", "'search_query'"),
        ("/v1/embed", {"texts": ["a"], "images": ["data:image/png;base64,AA=="]}, "images",
         "send images to /v2/embed"),
        ("/v1/embed", {"texts": ["a"], "truncate": "MIDDLE"}, "truncate", "'NONE'"),
        ("/v1/embed", {"texts": ["a"], "ranges": [[0.0], [1.0]]}, "ranges", "int8 or uint8"),
        ("/v1/embed", {"texts": ["a"], "embedding_types": ["int8"], "ranges": [[0.0], [1.0]]},
         "ranges", "[2, 384]"),
        ("/v1/tokenize", {"text": ""}, "text", "1 to 65536"),
        ("/v1/tokenize", {"text": "a" * 65537}, "text", "1 to 65536"),
        ("/v1/tokenize", {"text": 5}, "text", "valid string"),
        ("/v1/tokenize", {"text": "a." * 20000}, "text", "has 40000 tokens"),  # > 32768
        ("/v1/detokenize", {"tokens": []}, "tokens", "1 to 65536"),
        ("/v1/detokenize", {"tokens": [5, 40000]}, "tokens", "tokens 1 is 40000"),
        ("/v1/detokenize", {"tokens": [-1]}, "tokens", "tokens 0 is -1"),
        ("/v1/detokenize", {"tokens": ["a"]}, "tokens", "valid integer"),
    ],
)  # fmt: skip
def test_bad_v1_requests_are_400s_naming_the_field(server, path, body, param, says):
    assert_error(post(server, path, **body), 400, "invalid_request_error", param=param, says=says)


def test_v1_routes_answer_404_for_an_unknown_model(server):
    for path, body in [("/v1/embed", {"texts": ["a"]}), ("/v1/tokenize", {"text": "a"}),
                       ("/v1/detokenize", {"tokens": [5]})]:  # fmt: skip
        r = post(server, path, model="command-r", **body)
        assert_error(r, 404, "invalid_request_error", param="model", says="command-r")


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
