"""Vision-language embedders over HTTP on one real ``pipepool serve`` of a tiny Qwen2-VL and a
tiny ColQwen2. vLLM's chat form (``messages``) on ``/v1/embeddings`` (the official openai
client) and ``/pooling``: the conversation rendered by the model's chat template as vLLM
renders it (``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``),
against transformers on the processor's rendering and against ``Engine.embed`` of the same
input; Cohere's ``/v2/embed`` ``inputs`` (content parts) and ``images`` (the official cohere
client) against the Python API's dict inputs; ColQwen2's token vectors on ``/pooling`` and its
MaxSim on ``/score`` and ``/rerank`` (pages as vLLM's content parts) against ``Engine.score``
and ``Engine.rerank``; every refusal a 400 naming the request's field."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from test_images_server import ImageHost, assert_answered_as_online, batch_file
from test_server import ServerProcess
from test_server_limits import assert_error
from tiny_models import MIN_COSINE, cosine
from tiny_towers import png_bytes, sample_images
from tiny_vlm import make_colqwen2, make_qwen2_vl, reference

import pipepool

IMAGES = sample_images()
PNGS = [png_bytes(image) for image in IMAGES]


def data_uri(blob: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(blob).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


@pytest.fixture(scope="module")
def paths(model_dir) -> dict[str, Path]:
    vlm = make_qwen2_vl(model_dir / "qwen2_vl-http")
    return {"vlm": vlm, "colqwen2": make_colqwen2(vlm, model_dir / "colqwen2-http")}


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("vlm-media")
    (folder / "page.png").write_bytes(PNGS[2])
    return folder


@pytest.fixture(scope="module")
def image_host():
    host = ThreadingHTTPServer(("127.0.0.1", 0), ImageHost)
    host.daemon_threads = True
    threading.Thread(target=host.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{host.server_address[1]}"
    finally:
        host.shutdown()


@pytest.fixture(scope="module")
def server(paths, media, tmp_path_factory):
    log = tmp_path_factory.mktemp("vlm-server") / "serve.log"
    args = [arg for name, path in paths.items() for arg in ("--model", f"{name}={path}")]
    args += ["--allowed-local-media-path", str(media), "--allowed-media-domains", "127.0.0.1"]
    args += ["--state-dir", str(log.parent / "state")]  # the Batch API's files
    s = ServerProcess(args, log)
    try:
        yield s.wait_ready(timeout=180)
    finally:
        s.stop()


@pytest.fixture(scope="module")
def vlm_engine(paths):
    with pipepool.Engine(str(paths["vlm"])) as engine:
        yield engine


@pytest.fixture(scope="module")
def vlm_reference(paths):
    """(transformers' Qwen2VLModel, its processor) of the served Qwen2-VL."""
    return reference(paths["vlm"])


@pytest.fixture(scope="module")
def colqwen2_engine(paths):
    with pipepool.Engine(str(paths["colqwen2"])) as engine:
        yield engine


def post(server: ServerProcess, path: str, model: str = "vlm", **body) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": model, **body}, timeout=60)


def vector(r: httpx.Response, key: str = "embedding") -> np.ndarray:
    assert r.status_code == 200, r.text
    assert len(r.json()["data"]) == 1
    return np.array([r.json()["data"][0][key]], dtype=np.float32)


def test_openai_client_messages_equal_the_python_api(server, vlm_engine):
    """One user message of an image and a text, with the generation prompt: the vector of
    ``Engine.embed``'s dict input (which is rendered so); through the official openai client."""
    import openai
    from openai.types import CreateEmbeddingResponse

    # embeddings.create requires input; vLLM's own example posts the chat body with the client
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": [image_part(data_uri(PNGS[0])), text_part("a cat")]}]
    body = {"model": "vlm", "messages": messages, "add_generation_prompt": True}
    answer = client.post("/embeddings", body=body, cast_to=CreateEmbeddingResponse)
    got = np.array([answer.data[0].embedding], dtype=np.float32)
    want = vlm_engine.embed([{"text": "a cat", "image": IMAGES[0]}])
    assert float(cosine(got, want)[0]) >= MIN_COSINE
    tokens = vlm_engine.pool([{"text": "a cat", "image": IMAGES[0]}], pooling="all")[0]
    assert answer.usage.prompt_tokens == len(tokens)  # the placeholders counted
    r = post(server, "/pooling", task="embed", messages=messages, add_generation_prompt=True)
    assert float(cosine(vector(r, "data"), want)[0]) >= MIN_COSINE


def _reference_vector(model, processor, messages, images, **options) -> np.ndarray:
    """transformers on the processor's rendering of ``messages`` (vLLM's openai content
    format: image parts as {"type": "image"}) with ``options``, the last token's state."""
    text = processor.apply_chat_template(messages, tokenize=False, **options)
    inputs = processor(text=[text], images=images or None, return_tensors="pt")
    with torch.no_grad():
        return model(**inputs).last_hidden_state[0, -1].numpy()[None]


CONVERSATIONS = [
    # vLLM's defaults: no generation prompt; a system message, a string content
    ([{"role": "system", "content": "Embed the page."},
      {"role": "user", "content": [image_part("IMG0"), text_part("the title")]}], {}),
    # several messages and images, text between images, the generation prompt
    ([{"role": "user", "content": [text_part("compare"), image_part("IMG1"), text_part("and"),
                                   image_part("IMG3")]},
      {"role": "assistant", "content": "they differ"},
      {"role": "user", "content": "how?"}], {"add_generation_prompt": True}),
    # the final message left open
    ([{"role": "user", "content": [image_part("IMG2")]},
      {"role": "assistant", "content": [text_part("This page shows ")]}],
     {"continue_final_message": True}),
    # a variable of the template
    ([{"role": "user", "content": [image_part("IMG0"), image_part("IMG4"), text_part("two")]}],
     {"chat_template_kwargs": {"add_vision_id": True}}),
]  # fmt: skip


def _with_urls(messages: list[dict], url) -> tuple[list[dict], list[dict], list[int]]:
    """(the request's messages, the template's messages, the images' indices)."""
    sent, rendered, order = [], [], []
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            content = [text_part(content)]
        parts_sent, parts_rendered = [], []
        for p in content:
            if p["type"] == "image_url":
                i = int(p["image_url"]["url"].removeprefix("IMG"))
                order.append(i)
                parts_sent.append(image_part(url(i)))
                parts_rendered.append({"type": "image"})
            else:
                parts_sent.append(p)
                parts_rendered.append(p)
        sent.append({"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                     else parts_sent})  # fmt: skip
        rendered.append({"role": m["role"], "content": parts_rendered})
    return sent, rendered, order


@pytest.mark.parametrize(("messages", "options"), CONVERSATIONS)
def test_messages_render_as_vllm(server, vlm_reference, vlm_engine, messages, options):
    """Each conversation against transformers on the processor's rendering with the same
    options (cos >= 0.99999), and against ``Engine.embed`` of the same ``ChatPrompt``."""
    model, processor = vlm_reference
    sent, rendered, order = _with_urls(messages, lambda i: data_uri(PNGS[i]))
    r = post(server, "/v1/embeddings", messages=sent, **options)
    got = vector(r)
    kwargs = options.get("chat_template_kwargs", {})
    flags = {k: v for k, v in options.items() if k != "chat_template_kwargs"}
    want = _reference_vector(model, processor, rendered, [IMAGES[i] for i in order],
                             **flags, **kwargs)  # fmt: skip
    assert float(cosine(got, want)[0]) >= MIN_COSINE
    images = iter(IMAGES[i] for i in order)  # Python's form: the images themselves
    python = [{"role": m["role"], "content": [
        {"type": "image", "image": next(images)} if p["type"] == "image" else p
        for p in m["content"]
    ]} for m in rendered]  # fmt: skip
    prompt = pipepool.ChatPrompt.from_messages(python, template_kwargs=kwargs, **flags)
    assert float(cosine(got, vlm_engine.embed([prompt]))[0]) >= MIN_COSINE


def test_files_remote_images_and_token_vectors(server, vlm_engine, media, image_host):
    """A file under the allowed folder and an image of an allowed host are the images they
    hold; /pooling's token_embed gives the conversation's token vectors."""
    messages = [{"role": "user", "content": [image_part(f"file://{media / 'page.png'}"),
                                             image_part(f"{image_host}/cat.png"),
                                             text_part("pages")]}]  # fmt: skip
    item = {"text": "pages", "images": [IMAGES[2], IMAGES[0]]}
    r = post(server, "/v1/embeddings", messages=messages, add_generation_prompt=True)
    assert float(cosine(vector(r), vlm_engine.embed([item]))[0]) >= MIN_COSINE
    r = post(server, "/pooling", task="token_embed", messages=messages, add_generation_prompt=True)
    assert r.status_code == 200, r.text
    got = np.array(r.json()["data"][0]["data"], dtype=np.float32)
    want = vlm_engine.pool([item], pooling="all")[0]
    assert got.shape == want.shape and float(cosine(got, want).min()) >= MIN_COSINE


IMAGE_MESSAGE = [{"role": "user", "content": [image_part(data_uri(PNGS[1])), text_part("x")]}]


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"chat_template": "{{ messages }}"}, "chat_template", "own chat template"),
        ({"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs",
         "reads no variable 'enable_thinking'"),
        ({"chat_template_kwargs": {"add_generation_prompt": True}}, "chat_template_kwargs",
         "set from the request's own fields"),
        ({"add_generation_prompt": True, "continue_final_message": True},
         "continue_final_message", "cannot both be true"),
        ({"truncate_prompt_tokens": 4}, "truncate_prompt_tokens", "applies to texts"),
        ({"messages": [{"role": "user", "content": [image_part(data_uri(PNGS[1]))]}],
          "continue_final_message": True}, "continue_final_message", "no text part"),
        ({"messages": [{"role": "user", "content": [image_part(data_uri(b"junk"))]}]},
         "messages", "messages: not a decodable image"),
        ({"messages": [{"role": "user", "content": [image_part("http://example.com/a.png")]}]},
         "messages", "--allowed-media-domains does not name"),
        ({"messages": None, "input": ["x"], "add_generation_prompt": True},
         "add_generation_prompt", "applies to messages"),
    ],
)  # fmt: skip
def test_messages_refusals_name_the_field(server, body, param, says):
    full = {"messages": IMAGE_MESSAGE, **body}
    full = {k: v for k, v in full.items() if v is not None}
    r = post(server, "/v1/embeddings", **full)
    assert_error(r, 400, "invalid_request_error", param=param, says=says)


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"chat_template_kwargs": {"enable_thinking": True}}, "reads no variable"),
        ({"chat_template_kwargs": {"messages": []}}, "set from the request's own fields"),
        ({"add_generation_prompt": True, "continue_final_message": True}, "cannot both be true"),
    ],
)  # fmt: skip
def test_template_options_refused_before_any_image_is_fetched(server, image_host, options, says):
    """The template's checks come before the fetch: a URL whose fetch would fail (the host
    answers 404, a 400 naming messages) is never fetched when the options are refused."""
    messages = [{"role": "user", "content": [image_part(f"{image_host}/missing.png"),
                                             text_part("x")]}]  # fmt: skip
    r = post(server, "/v1/embeddings", messages=messages)
    assert_error(r, 400, "invalid_request_error", param="messages", says="404")
    r = post(server, "/v1/embeddings", messages=messages, **options)
    param = "chat_template_kwargs" if "chat_template_kwargs" in options else None
    assert_error(r, 400, "invalid_request_error", param=param or "continue_final_message",
                 says=says)  # fmt: skip


def test_cohere_inputs_and_images_equal_the_python_api(server, vlm_engine, image_host):
    """Cohere's content parts: one user message of the parts in order, with the generation
    prompt, as ``Engine.embed`` renders a dict input; ``images``: ``{"image": ...}``."""
    import cohere

    client = cohere.ClientV2(base_url=server.url, api_key="unused")
    inputs = [
        {"content": [image_part(data_uri(PNGS[0])), text_part("a cat")]},
        {"content": [text_part("only words")]},
        {"content": [image_part(f"{image_host}/cat.png"), image_part(data_uri(PNGS[3])),
                     text_part("two")]},
    ]  # fmt: skip
    answer = client.embed(model="vlm", inputs=inputs, input_type="search_document",
                          embedding_types=["float"])  # fmt: skip
    got = np.array(answer.embeddings.float_, dtype=np.float32)
    want = vlm_engine.embed([
        {"text": "a cat", "image": IMAGES[0]}, {"text": "only words"},
        {"text": "two", "images": [IMAGES[0], IMAGES[3]]},
    ])  # fmt: skip
    assert got.shape == want.shape and float(cosine(got, want).min()) >= MIN_COSINE
    answer = client.embed(model="vlm", images=[data_uri(PNGS[1])], input_type="image",
                          embedding_types=["float"])  # fmt: skip
    got = np.array(answer.embeddings.float_, dtype=np.float32)
    assert float(cosine(got, vlm_engine.embed([{"image": IMAGES[1]}]))[0]) >= MIN_COSINE
    r = post(server, "/v2/embed", input_type="search_query", truncate="END",
             inputs=[{"content": [text_part("x")]}])  # fmt: skip
    assert_error(r, 400, "invalid_request_error", param="truncate", says="applies to texts")
    r = post(server, "/v2/embed", input_type="search_query",
             inputs=[{"content": [image_part(data_uri(b"junk"))]}])  # fmt: skip
    assert_error(r, 400, "invalid_request_error", param="inputs", says="inputs[0]:")
    r = post(server, "/v2/embed", model="colqwen2", input_type="search_query", texts=["x"])
    assert_error(r, 400, "invalid_request_error", param="model", says="one vector per token")


def test_colqwen2_token_vectors(server, colqwen2_engine, media):
    """/pooling's token_embed (ColQwen2's default task) of a query and of a page; one vector
    per input is refused where a route answers one (/v1/embeddings, task embed)."""
    r = post(server, "/pooling", model="colqwen2", input=["which page shows the chart"])
    assert r.status_code == 200, r.text
    got = np.array(r.json()["data"][0]["data"], dtype=np.float32)
    want = colqwen2_engine.pool([{"text": "which page shows the chart"}], pooling="all")[0]
    assert got.shape == want.shape and float(cosine(got, want).min()) >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)  # as it makes them
    r = post(server, "/pooling", model="colqwen2", input=["x"], truncate_prompt_tokens=2)
    assert_error(r, 400, "invalid_request_error", param="truncate_prompt_tokens")
    messages = [{"role": "user", "content": [image_part(f"file://{media / 'page.png'}")]}]
    r = post(server, "/pooling", model="colqwen2", task="token_embed", messages=messages)
    assert r.status_code == 200, r.text
    got = np.array(r.json()["data"][0]["data"], dtype=np.float32)
    want = colqwen2_engine.pool([{"image": IMAGES[2]}], pooling="all")[0]
    assert got.shape == want.shape and float(cosine(got, want).min()) >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
    r = post(server, "/pooling", model="colqwen2", task="embed", input=["x"])
    assert_error(r, 400, "invalid_request_error", param="task", says="one vector per token")
    r = post(server, "/v1/embeddings", model="colqwen2", input=["x"])
    assert_error(r, 400, "invalid_request_error", param="model", says="token_embed")
    both = [{"role": "user", "content": [image_part(data_uri(PNGS[0])), text_part("x")]}]
    r = post(server, "/pooling", model="colqwen2", task="token_embed", messages=both)
    assert_error(r, 400, "invalid_request_error", param="messages", says="a query (one text")


def page(blob: bytes) -> dict:
    return {"content": [image_part(data_uri(blob))]}


def test_colqwen2_score_and_rerank_equal_the_python_api(server, colqwen2_engine, image_host):
    """MaxSim of text queries against page images given as vLLM's content parts (data URIs and
    a URL of an allowed host): the scores and order of ``Engine.score`` / ``Engine.rerank``."""
    query, pages = "which page shows the chart", [page(PNGS[i]) for i in range(4)]
    pages[3] = {"content": [image_part(f"{image_host}/cat.png")]}
    images = [*IMAGES[:3], IMAGES[0]]
    r = post(server, "/score", model="colqwen2", queries=query, documents=pages)
    assert r.status_code == 200, r.text
    got = [d["score"] for d in r.json()["data"]]
    np.testing.assert_allclose(got, colqwen2_engine.score(query, images), rtol=1e-5)
    queries = [{"content": [text_part("a cat")]}, "a chart", "a table"]
    r = post(server, "/score", model="colqwen2", text_1=queries, text_2=pages[:3])
    assert r.status_code == 200, r.text
    got = [d["score"] for d in r.json()["data"]]
    want = colqwen2_engine.score(["a cat", "a chart", "a table"], images[:3])
    np.testing.assert_allclose(got, want, rtol=1e-5)
    r = post(server, "/rerank", model="colqwen2", query=query, documents=pages, top_n=3)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    want_ranked = colqwen2_engine.rerank(query, images, top_n=3)
    assert [x["index"] for x in results] == [x.index for x in want_ranked]
    np.testing.assert_allclose([x["relevance_score"] for x in results],
                               [x.relevance_score for x in want_ranked], rtol=1e-5)  # fmt: skip
    assert r.json()["usage"]["total_tokens"] > 0


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        ("/rerank", {"query": "q", "documents": ["a text page"]}, "documents",
         "a ColQwen2 document is a page image"),
        ("/rerank", {"query": "q", "documents": [page(PNGS[0])], "instruction": "find"},
         "instruction", "does not apply"),
        ("/rerank", {"query": "q", "documents": [page(PNGS[0])], "return_documents": True},
         "return_documents", "does not apply"),
        ("/rerank", {"query": page(PNGS[0]), "documents": [page(PNGS[0])]}, "query",
         "a ColQwen2 query is a string"),
        ("/score", {"queries": "q", "documents": [page(b"junk")]}, "documents",
         "documents[0]: not a decodable image"),
        ("/score", {"queries": "q", "documents": [page(PNGS[0])], "max_tokens_per_doc": 3},
         "max_tokens_per_doc", "does not apply"),
        ("/score", {"text_1": ["a", "b"], "text_2": [page(PNGS[0])] * 3}, "text_1",
         "give one query"),
        ("/rerank", {"query": "q", "documents": [{"content": [image_part(data_uri(PNGS[0])),
                                                              text_part("x")]}]},
         "documents", "content of one image_url part"),
    ],
)  # fmt: skip
def test_colqwen2_scoring_refusals_name_the_field(server, path, body, param, says):
    r = post(server, path, model="colqwen2", **body)
    assert_error(r, 400, "invalid_request_error", param=param, says=says)


def batch_bodies(media: Path) -> dict[str, list[dict]]:
    """Bodies per route for the Qwen2-VL: vLLM's chat form and Cohere's inputs, a bad image."""
    messages = [{"role": "user", "content": [image_part(f"file://{media / 'page.png'}"),
                                             text_part("a page")]}]  # fmt: skip
    return {
        "/v1/embeddings": [
            {"model": "vlm", "messages": messages, "add_generation_prompt": True},
            {"model": "vlm", "messages": [{"role": "user", "content": "only words"}]},
            {"model": "vlm", "messages": [{"role": "user",
                                           "content": [image_part(data_uri(b"junk"))]}]},
        ],
        "/v2/embed": [
            {"model": "vlm", "input_type": "search_document",
             "inputs": [{"content": [image_part(data_uri(PNGS[1])), text_part("x")]}]},
        ],
    }  # fmt: skip


def test_batch_api_lines_answer_as_online(server, media):
    """Batch API lines of vLLM's chat form and Cohere's inputs for the Qwen2-VL: each line
    answered as the online route answers its body (vectors, and a bad image's error)."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    bodies = batch_bodies(media)
    for route, some in bodies.items():
        source = client.files.create(file=("b.jsonl", batch_file(bodies, route)), purpose="batch")
        batch = client.batches.create(
            input_file_id=source.id,
            endpoint=route,
            completion_window="24h",  # type: ignore[arg-type]
        )
        deadline = time.monotonic() + 60
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.05)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        lines = [
            json.loads(x)
            for file_id in (batch.output_file_id, batch.error_file_id) if file_id
            for x in client.files.content(file_id).text.splitlines()
        ]  # fmt: skip
        assert len(lines) == len(some)
        assert_answered_as_online(server, {route: some}, lines)


def test_run_batch_lines_answer_as_online(server, paths, media, tmp_path):
    bodies = batch_bodies(media)
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(batch_file(bodies))
    command = [sys.executable, "-m", "pipepool", "run-batch", "-i", str(source), "-o",
               str(output), "--model", str(paths["vlm"]), "--served-model-name", "vlm",
               "--allowed-local-media-path", str(media)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(x) for x in output.read_bytes().splitlines()]
    assert len(lines) == sum(len(b) for b in bodies.values())
    assert_answered_as_online(server, bodies, lines)


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        ([], "messages must be a non-empty list"),
        ([{"role": "tool", "content": "x"}], r"messages\[0\].role must be one of"),
        ([{"role": "user", "content": "x", "name": "a"}], r"messages\[0\] must be a message"),
        ([{"role": "user", "content": [image_part("data:,")]}],
         r"messages\[0\].content\[0\] must be"),
    ],
)  # fmt: skip
def test_python_conversations_refuse_what_they_do_not_take(messages, says):
    with pytest.raises(pipepool.InvalidInputError, match=says):
        pipepool.ChatPrompt.from_messages(messages)


def test_page_retrievers_render_no_conversation(colqwen2_engine):
    prompt = pipepool.ChatPrompt.from_messages([{"role": "user", "content": "a query"}])
    with pytest.raises(pipepool.InvalidInputError, match="input 0: ColQwen2 renders no chat"):
        colqwen2_engine.pool([prompt], pooling="all")


@pytest.fixture(scope="module")
def colqwen2_alone(paths, tmp_path_factory):
    """A server of the ColQwen2 alone: TEI's routes name no model, so only a server whose one
    embedding model is a page retriever reaches it on them."""
    log = tmp_path_factory.mktemp("colqwen2-server") / "serve.log"
    s = ServerProcess(["--model", str(paths["colqwen2"]), "--served-model-name", "colqwen2"], log)
    try:
        yield s.wait_ready(timeout=180)
    finally:
        s.stop()


_Q = {"model": "colqwen2"}
# Per route that answers one vector per input or takes texts only, bodies a text model takes.
REFUSING_ROUTES = {
    "/v1/embeddings": [{**_Q, "input": ["x"]}, {**_Q, "input": ["x"], "outputs": ["multi_vector"]},
                       {**_Q, "input": ["x"], "outputs": ["sparse"]},
                       {**_Q, "messages": [{"role": "user", "content": "x"}]}],
    "/pooling": [{**_Q, "input": ["x"], "task": t}
                 for t in ("embed", "classify", "token_classify")],
    "/v1/embed": [{**_Q, "texts": ["x"], "input_type": "search_query"}],
    "/v2/embed": [{**_Q, "texts": ["x"], "input_type": "search_query"},
                  {**_Q, "inputs": [{"content": [text_part("x")]}], "input_type": "search_query"}],
    "/classify": [{**_Q, "input": ["x"]}],
    "/v1/classify": [{**_Q, "input": ["x"]}],
    "/embed": [{"inputs": "x"}],
    "/embed_all": [{"inputs": "x"}],
    "/embed_sparse": [{"inputs": "x"}],
    "/similarity": [{"inputs": {"source_sentence": "x", "sentences": ["y"]}}],
    "/predict": [{"inputs": "x"}],
    "/": [{"inputs": "x"}],
    "/invocations": [{"inputs": "x"}],
}  # fmt: skip
TEI_ROUTES = {"/embed", "/embed_all", "/embed_sparse", "/similarity", "/predict", "/",
              "/invocations"}  # fmt: skip
# The routes that serve a page retriever (test_colqwen2_*), and those that run no model.
SERVING_ROUTES = {"/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"}
OTHER_ROUTES = {"/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize", "/decode",
                "/v1/files", "/v1/batches", "/v1/batches/{batch_id}/cancel"}  # fmt: skip


def test_page_retrievers_refused_by_every_route_that_cannot_serve_them(colqwen2_alone):
    """Every POST route of the app is accounted for (a new one fails here until it is); each
    that answers one vector per input or reads texts only refuses a ColQwen2 with a 400 in its
    peer's error body (TEI's: 422 Validation) saying it is a page retriever and naming the
    routes that serve it, never a generic check's message or a 500."""
    spec = httpx.get(colqwen2_alone.url + "/openapi.json", timeout=10).json()
    posts = {path for path, ops in spec["paths"].items() if "post" in ops}
    assert posts == set(REFUSING_ROUTES) | SERVING_ROUTES | OTHER_ROUTES
    served_by = "/pooling with task token_embed (its token vectors), and by /score and /rerank"
    for path, bodies in REFUSING_ROUTES.items():
        for body in bodies:
            r = httpx.post(colqwen2_alone.url + path, json=body, timeout=30)
            if path in TEI_ROUTES:
                assert r.status_code == 422, (path, r.text)
                assert r.json()["error_type"] == "Validation", (path, r.text)
                message = r.json()["error"]
            else:
                param = "task" if path == "/pooling" else "model"
                message = assert_error(r, 400, "invalid_request_error", param=param)["message"]
            assert "is ColQwen2, a page retriever: it gives one vector per token" in message
            assert served_by in message, (path, body, message)
    r = post(colqwen2_alone, "/pooling", model="colqwen2", input=["x"], task="multi_vector")
    assert_error(r, 400, "invalid_request_error", param="task", says="its tasks: token_embed")
