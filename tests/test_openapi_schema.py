"""Issue 37 item 6: the OpenAPI schema says what the server takes, no model needed. Bounds the
server checks itself are stated in the schema (non-empty texts and lists, token ids from 0,
truncate_prompt_tokens -1 or positive, exactly one of a request's alternative fields); those
of its settings and of its model are filled in (no token-id inputs without
--allow-token-ids, list lengths, the vocabulary, the vector size, the prompt names);
integers are JSON Schema's (2.0 is one); a multipart form's fields are never null, and an
upload's expiry fields come together; a file listing takes only the purposes it states; a 405
names every method of the path; a file deleted before its content is read is a 404. The whole
schema against a real server: ``benchmarks/schema_conformance.py`` (schemathesis, with the
rules JSON Schema cannot state told to it in ``benchmarks/schema_hooks.py``)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pipepool.server.app import build_app
from pipepool.server.batch_protocol import CreateBatchRequest, ExpiresAfter
from pipepool.server.front import AsyncEngine
from pipepool.server.models import ServedModels
from pipepool.server.openapi import ModelBounds, bound_schema
from pipepool.server.owner import EngineOwner
from pipepool.server.protocol import EmbeddingRequest
from pipepool.server.settings import ServerSettings

MODEL = ModelBounds(vocab_size=1000, output_dim=64, max_model_len=128, prompt_names=("query",))


@pytest.fixture
def make_app(tmp_path):
    """Apps whose model never loads (the schema, and the routes that need no model), by their
    settings (the state directory a temporary one)."""
    fronts = []

    def make(**settings) -> FastAPI:
        fronts.append(AsyncEngine(EngineOwner(lambda: None), max_queued=16))
        models = ServedModels.one(fronts[-1], ("tiny",))
        return build_app(ServerSettings(state_dir=str(tmp_path), **settings), models)

    yield make
    for front in fronts:
        front.close()


@pytest.fixture
def app(make_app) -> FastAPI:
    return make_app()


def generic(app) -> dict:
    """The schema before the server's bounds (without the model's: it is not loaded)."""
    return copy.deepcopy(app.openapi())


def schemas(schema: dict) -> dict:
    return schema["components"]["schemas"]


def test_bounds_the_server_checks_are_stated(app):
    s = schemas(generic(app))
    text, texts = s["EmbeddingRequest"]["properties"]["input"]["anyOf"]
    assert text == {"type": "string", "minLength": 1}
    assert texts["minItems"] == 1 and texts["items"]["minLength"] == 1
    assert s["DetokenizeRequest"]["properties"]["tokens"]["items"]["minimum"] == 0
    truncate = s["PoolingRequest"]["properties"]["truncate_prompt_tokens"]["anyOf"]
    assert truncate[0] == {"const": -1} and truncate[1]["minimum"] == 1
    assert s["TEIEmbedRequest"]["properties"]["dimensions"]["anyOf"][0]["minimum"] == 1
    # One of documents (Cohere, Jina) and texts (TEI), as the route takes them.
    assert [b["required"] for b in s["RerankRequest"]["anyOf"]] == [["documents"], ["texts"]]
    assert [b["required"] for b in s["TokenizeRequest"]["anyOf"]] == [
        ["prompt"], ["input"], ["inputs"]
    ]  # fmt: skip


def test_token_id_inputs_are_in_the_schema_only_where_the_server_takes_them(make_app):
    refused = schemas(generic(make_app()))["EmbeddingRequest"]["properties"]["input"]["anyOf"]
    assert [form["type"] for form in refused] == ["string", "array"]
    allowed = generic(make_app(allow_token_ids=True))
    bound_schema(allowed, ServerSettings(allow_token_ids=True), MODEL)
    forms = schemas(allowed)["EmbeddingRequest"]["properties"]["input"]["anyOf"]
    assert len(forms) == 4
    assert forms[2]["items"] == {
        "type": "integer", "minimum": 0, "maximum": 999, "x-bounded-by": "vocab_size"
    }  # fmt: skip


def test_the_model_and_the_settings_bound_the_schema(app):
    schema = generic(app)
    bound_schema(schema, ServerSettings(max_inputs_per_request=8), MODEL)
    s = schemas(schema)
    assert s["EmbeddingRequest"]["properties"]["input"]["anyOf"][1]["maxItems"] == 8
    assert s["EmbeddingRequest"]["properties"]["dimensions"]["anyOf"][0]["maximum"] == 64
    assert s["CohereEmbedRequest"]["properties"]["output_dimension"]["anyOf"][0]["maximum"] == 64
    assert s["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == 999
    truncate = s["PoolingRequest"]["properties"]["truncate_prompt_tokens"]["anyOf"]
    assert truncate[1]["maximum"] == 128
    assert s["TEIEmbedRequest"]["properties"]["prompt_name"]["anyOf"][0]["enum"] == ["query"]
    # A model without prompts takes no prompt_name but null.
    bound_schema(schema, ServerSettings(), ModelBounds(1000, 64, 128, prompt_names=()))
    assert schemas(schema)["TEIEmbedRequest"]["properties"]["prompt_name"]["anyOf"] == [
        {"type": "null"}
    ]  # fmt: skip


def test_pooling_tasks_offered_are_the_model_s(app):
    """vLLM's /pooling task: the schema offers the tasks pipepool does until the model is
    loaded, then those of the model (any other name is the route's 400, naming them)."""
    schema = generic(app)
    task = schemas(schema)["PoolingRequest"]["properties"]["task"]["anyOf"][0]
    assert task["enum"] == ["embed", "classify", "token_embed", "token_classify"]
    bound_schema(schema, ServerSettings(), replace(MODEL, tasks=("embed", "token_embed")))
    task = schemas(schema)["PoolingRequest"]["properties"]["task"]["anyOf"][0]
    assert task["enum"] == ["embed", "token_embed"]


def test_pair_options_are_offered_only_where_the_model_takes_them(app):
    for takes in (frozenset(), frozenset({"weights"}), frozenset({"instruction"})):
        schema = generic(app)
        bound_schema(schema, ServerSettings(), replace(MODEL, pair_options=takes))
        for request in ("RerankRequest", "ScoreRequest"):
            fields = schemas(schema)[request]["properties"]
            weights, instruction = fields["weights"]["anyOf"], fields["instruction"]["anyOf"]
            if "weights" in takes:
                assert weights[0]["minItems"] == weights[0]["maxItems"] == 3
            else:
                assert weights == [{"type": "null"}]
            if "instruction" in takes:
                assert instruction[0]["type"] == "string"
            else:
                assert instruction == [{"type": "null"}]


def test_the_rerank_answer_is_cohere_s_object_or_tei_s_array(app):
    answer = generic(app)["paths"]["/rerank"]["post"]["responses"]["200"]["content"]
    forms = answer["application/json"]["schema"]["anyOf"]
    assert forms[0]["$ref"].endswith("/RerankResponse")
    assert forms[1]["type"] == "array" and forms[1]["items"]["$ref"].endswith("/TEIRank")


def test_integers_are_json_schema_integers():
    assert EmbeddingRequest(input="a", dimensions=2.0, top_k=3.0).dimensions == 2
    for not_an_integer in (True, "2", 2.5):
        with pytest.raises(ValueError):
            EmbeddingRequest(input="a", dimensions=not_an_integer)
    expiry = {"anchor": "created_at", "seconds": 7200.0}
    assert CreateBatchRequest(
        input_file_id="f", endpoint="/v1/embeddings", completion_window="24h",
        output_expires_after=expiry,
    ).output_expires_after.seconds == 7200  # fmt: skip
    for not_an_integer in (True, "7200", 7200.5):
        with pytest.raises(ValueError):
            ExpiresAfter(anchor="created_at", seconds=not_an_integer)


def test_upload_form_fields_are_never_null_and_its_expiry_comes_whole(app):
    schema = generic(app)
    body = schema["paths"]["/v1/files"]["post"]["requestBody"]["content"]["multipart/form-data"]
    form = body["schema"]  # inline: the route reads its form as it streams (upload_stream.py)
    fields = form["properties"]
    assert form["additionalProperties"] is False  # any other field is refused by name
    assert fields["expires_after[anchor]"]["type"] == "string"
    assert fields["expires_after[seconds]"]["type"] == "integer"
    assert not any("anyOf" in field for field in fields.values())
    assert body["schema"]["dependentRequired"] == {
        "expires_after[anchor]": ["expires_after[seconds]"],
        "expires_after[seconds]": ["expires_after[anchor]"],
    }
    with TestClient(app) as client:
        upload = {"files": {"file": ("a.jsonl", b"{}\n")}}
        for one in ({"expires_after[anchor]": "created_at"}, {"expires_after[seconds]": "3600"}):
            r = client.post("/v1/files", data={"purpose": "batch", **one}, **upload)
            assert r.status_code == 400 and r.json()["error"]["param"] == "expires_after"


def test_a_file_listing_takes_the_purposes_it_states(app):
    with TestClient(app) as client:
        for purpose in ("batch", "batch_output"):
            assert client.get("/v1/files", params={"purpose": purpose}).status_code == 200
        r = client.get("/v1/files", params={"purpose": "null"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"


def test_a_405_names_every_method_of_the_path(app):
    with TestClient(app) as client:
        r = client.request("PUT", "/v1/batches")
        assert r.status_code == 405
        assert r.headers["allow"] == "GET, POST"


def test_the_content_of_a_deleted_file_is_a_404(app):
    with TestClient(app) as client:
        made = client.post(
            "/v1/files", files={"file": ("a.jsonl", b"{}\n")}, data={"purpose": "batch"}
        )
        file_id = made.json()["id"]
        content = client.get(f"/v1/files/{file_id}/content")
        assert content.status_code == 200 and content.content == b"{}\n"
        app.state.batch_store.path(file_id).unlink()  # as a DELETE racing this read would
        assert client.get(f"/v1/files/{file_id}/content").status_code == 404
