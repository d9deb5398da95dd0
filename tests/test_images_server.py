"""Images over HTTP on a real ``pipepool serve`` of a tiny CLIP: Cohere's ``POST /v2/embed``
``images`` (data URIs) through the official cohere v2 client, vLLM's chat form (``messages``
with ``image_url`` parts) on ``/v1/embeddings`` through the official openai client and on
``/pooling``, and both in the Batch API and ``pipepool run-batch`` lines: the same vectors as
``Engine.embed`` of the same images. Junk bytes, a 30,000 x 30,000 PNG header and remote URLs
(http, https, unreachable) each a 400 naming the input in under a second, the server's memory
unchanged, other clients answered meanwhile."""

from __future__ import annotations

import base64
import contextlib
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest
from test_server import ServerProcess
from test_server import _free_port as free_port
from test_server_limits import assert_error
from tiny_models import MIN_COSINE, cosine
from tiny_towers import make_clip, png_bytes, png_header, sample_images

import pipepool


def data_uri(blob: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(blob).decode()}"


@pytest.fixture(scope="module")
def clip_path(model_dir) -> Path:
    return make_clip(model_dir / "clip-server")


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    (folder / "cat.png").write_bytes(png_bytes(sample_images()[0]))
    return folder


class ImageHost(BaseHTTPRequestHandler):
    """A web server of images for the fetching tests: /cat.png, and the ways a host can
    misbehave (slow, too large without saying so, a redirect, a 404)."""

    def do_GET(self) -> None:
        cat = png_bytes(sample_images()[0])
        if self.path == "/slow.png":
            time.sleep(3)  # the host being slow: far over the server's --media-fetch-timeout
        if self.path in ("/cat.png", "/slow.png"):
            self._send(200, cat, {"Content-Length": str(len(cat))})
        elif self.path == "/big.png":  # no Content-Length: the body ends when the host closes
            self._send(200, cat + bytes(FETCH_MAX_BYTES), {})
        elif self.path == "/redirect.png":
            self._send(302, b"", {"Location": "/cat.png", "Content-Length": "0"})
        else:
            self._send(404, b"", {"Content-Length": "0"})

    def _send(self, status: int, body: bytes, headers: dict) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        with contextlib.suppress(OSError):  # the server under test may stop reading
            self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


FETCH_MAX_BYTES = 100_000


@pytest.fixture(scope="module")
def image_host():
    host = ThreadingHTTPServer(("127.0.0.1", 0), ImageHost)
    host.daemon_threads = True
    thread = threading.Thread(target=host.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{host.server_address[1]}"
    finally:
        host.shutdown()


@pytest.fixture(scope="module")
def server(clip_path, media, image_host, tmp_path_factory):
    log = tmp_path_factory.mktemp("images-server") / "serve.log"
    args = ["--model", str(clip_path), "--served-model-name", "clip"]
    args += ["--allowed-local-media-path", str(media), "--state-dir", str(log.parent / "state")]
    args += ["--allowed-media-domains", "127.0.0.1", "--media-fetch-timeout", "0.5"]
    args += ["--media-fetch-max-bytes", str(FETCH_MAX_BYTES)]
    s = ServerProcess(args, log)
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def clip_engine(clip_path):
    with pipepool.Engine(str(clip_path)) as engine:
        yield engine


def embed(server: ServerProcess, **body) -> httpx.Response:
    body.setdefault("model", "clip")
    body.setdefault("input_type", "image")
    return httpx.post(server.url + "/v2/embed", json=body, timeout=60)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_cohere_client_images_equal_the_python_api(server, clip_engine):
    import cohere

    images = sample_images()
    client = cohere.ClientV2(base_url=server.url, api_key="unused")
    answer = client.embed(
        model="clip", input_type="image", embedding_types=["float"],
        images=[data_uri(png_bytes(image)) for image in images],
    )  # fmt: skip
    got = np.array(answer.embeddings.float_, dtype=np.float32)
    want = clip_engine.embed(images)
    assert float(cosine(got, want).min()) >= MIN_COSINE
    assert [(i.width, i.height, i.format) for i in answer.images] == [
        (image.width, image.height, "png") for image in images
    ]
    assert answer.meta.billed_units.images == len(images)
    texts = embed(server, texts=["a photo of a cat"], input_type="search_query")
    assert texts.status_code == 200 and len(texts.json()["embeddings"]["float"][0]) == 24


@pytest.mark.parametrize(
    ("uri", "says"),
    [
        (data_uri(b"junk bytes, no image"), "images[1]: not a decodable image"),
        (data_uri(png_header(30_000, 30_000)), "images[1]: the image is over the limit"),
        (
            "https://example.com/cat.png",
            "images[1] is a remote URL of host 'example.com', which "
            "--allowed-media-domains does not name (127.0.0.1)",
        ),
        ("http://example.com/cat.png", "images[1] is a remote URL of host 'example.com'"),
        (
            "http://10.255.255.1:9/unreachable.png",
            "images[1] is a remote URL of host '10.255.255.1'",
        ),
        ("data:text/plain;base64,AAAA", "images[1] has media type 'text/plain'"),
        ("data:image/png;base64,@@@", "images[1]: its base64 payload"),
        ("file:///etc/hostname", "images[1]: /etc/hostname is outside the allowed folder"),
    ],
)
def test_bad_images_are_fast_400s_naming_the_input(server, uri, says):
    good = data_uri(png_bytes(sample_images()[0]))
    embed(server, images=[good])  # warm: the RSS below is the serving one
    before = rss_kib(server.proc.pid)
    start = time.monotonic()
    r = embed(server, images=[good, uri])
    assert time.monotonic() - start < 1.0
    assert_error(r, 400, "invalid_request_error", param="images", says=says)
    assert rss_kib(server.proc.pid) - before < 8 * 1024  # no decoded bomb held
    assert embed(server, images=[good]).status_code == 200  # others go on being answered


def test_image_requests_refuse_the_texts_options(server):
    good = data_uri(png_bytes(sample_images()[0]))
    for field, value in (("truncate", "START"), ("max_tokens", 5)):
        r = embed(server, images=[good], **{field: value})
        assert_error(r, 400, "invalid_request_error", param=field, says="applies to texts")
    r = embed(server, images=[good], embedding_types=["int8"])
    assert_error(r, 400, "invalid_request_error", param="embedding_types", says="need ranges")
    r = embed(server, images=[good], input_type="search_document")
    assert_error(r, 400, "invalid_request_error", param="input_type", says="goes with images")


def test_files_under_the_allowed_folder(server, media):
    inline = embed(server, images=[data_uri(png_bytes(sample_images()[0]))])
    local = embed(server, images=[f"file://{media / 'cat.png'}"])
    assert local.status_code == 200, local.text
    got = np.array(local.json()["embeddings"]["float"])
    assert float(cosine(got, np.array(inline.json()["embeddings"]["float"])).min()) >= MIN_COSINE


# -- remote images: fetched from the hosts --allowed-media-domains names, within limits ---------


def test_images_of_allowed_hosts_are_fetched(server, image_host):
    want = embed(server, images=[data_uri(png_bytes(sample_images()[0]))]).json()
    got = embed(server, images=[image_host + "/cat.png"])
    assert got.status_code == 200, got.text
    a, b = (np.array(x["embeddings"]["float"]) for x in (got.json(), want))
    assert float(cosine(a, b).min()) >= MIN_COSINE
    assert got.json()["images"] == want["images"]  # its size and format, from the fetched bytes
    chat = post(server, "/v1/embeddings", messages=image_message(image_host + "/cat.png"))
    assert chat.status_code == 200, chat.text
    assert float(cosine(np.array([chat.json()["data"][0]["embedding"]]), b).min()) >= MIN_COSINE


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("/slow.png", "could not be fetched: it took longer than 0.5 s (--media-fetch-timeout)"),
        ("/big.png", f"is over {FETCH_MAX_BYTES} bytes (--media-fetch-max-bytes)"),
        (
            "/redirect.png",
            "could not be fetched: HTTP 302 (to /cat.png: redirects are not followed)",
        ),
        ("/missing.png", "could not be fetched: HTTP 404"),
        (None, "could not be fetched: ConnectError"),  # nothing listens there
    ],
)
def test_remote_images_that_fail_are_fast_400s_naming_the_input(server, image_host, path, says):
    url = image_host + path if path else f"http://127.0.0.1:{free_port()}/cat.png"
    good = image_host + "/cat.png"
    before = rss_kib(server.proc.pid)
    start = time.monotonic()
    r = embed(server, images=[good, url])
    assert time.monotonic() - start < 1.0
    assert_error(r, 400, "invalid_request_error", param="images", says=f"images[1] {says}")
    r = post(server, "/v1/embeddings", messages=image_message(url))
    assert_error(r, 400, "invalid_request_error", param="messages",
                 says=f"messages[0].content[0].image_url.url {says}")  # fmt: skip
    assert rss_kib(server.proc.pid) - before < 8 * 1024


# -- vLLM's chat form: messages with image_url parts -------------------------------------------


def image_message(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]


def text_message(text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}]}]


def post(server: ServerProcess, path: str, **body) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "clip", **body}, timeout=60)


def test_openai_client_messages_equal_the_python_api(server, clip_engine):
    """vLLM's own example client: the openai client POSTs messages to /embeddings."""
    import openai
    from openai.types import CreateEmbeddingResponse

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    images, text = sample_images()[:3], "a photo of a cat"
    for image in images:
        body = {"model": "clip", "messages": image_message(data_uri(png_bytes(image)))}
        answer = client.post("/embeddings", body=body, cast_to=CreateEmbeddingResponse)
        got = np.array([answer.data[0].embedding], dtype=np.float32)
        assert len(answer.data) == 1
        assert float(cosine(got, clip_engine.embed([image]))[0]) >= MIN_COSINE
    body = {"model": "clip", "messages": text_message(text), "dimensions": 16}
    answer = client.post("/embeddings", body=body, cast_to=CreateEmbeddingResponse)
    got = np.array([answer.data[0].embedding], dtype=np.float32)
    want = clip_engine.embed([text], dimensions=16)
    assert float(cosine(got, want)[0]) >= MIN_COSINE
    assert answer.usage.prompt_tokens == len(clip_engine.tokenize([text])[0])
    plain = post(server, "/v1/embeddings", messages=[{"role": "user", "content": text}])
    assert plain.status_code == 200, plain.text  # a string content is one text part
    got = np.array([plain.json()["data"][0]["embedding"]])
    assert float(cosine(got, clip_engine.embed([text]))[0]) >= MIN_COSINE


def test_pooling_takes_messages(server, clip_engine, media):
    image = sample_images()[0]
    r = post(
        server, "/pooling", task="embed", messages=image_message(f"file://{media / 'cat.png'}")
    )
    assert r.status_code == 200, r.text
    got = np.array([r.json()["data"][0]["data"]], dtype=np.float32)
    assert float(cosine(got, clip_engine.embed([image]))[0]) >= MIN_COSINE
    text = "a photo of a dog"
    r = post(server, "/pooling", task="token_embed", messages=text_message(text))
    assert r.status_code == 200, r.text
    got = np.array(r.json()["data"][0]["data"], dtype=np.float32)
    want = clip_engine.embed_tokens([text])[0]
    assert got.shape == want.shape and float(cosine(got, want).min()) >= MIN_COSINE
    r = post(
        server, "/pooling", task="token_embed", messages=image_message(data_uri(png_bytes(image)))
    )
    assert_error(r, 400, "invalid_request_error", param="task", says="pooled vector only")


GOOD = data_uri(png_bytes(sample_images()[1]))
_PART = {"type": "image_url", "image_url": {"url": GOOD}}


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, _PART]}]},
         "messages", "messages[0].content holds 2 parts (image_url and text)"),
        ({"messages": [{"role": "user", "content": [_PART, _PART]}]},
         "messages", "holds 2 parts (image_url)"),
        ({"messages": text_message("a") + image_message(GOOD)}, "messages", "holds 2 messages"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
         "messages", "messages[0].content[0].type 'input_audio' is not taken"),
        ({"messages": [{"role": "user", "name": "x", "content": "a"}]},
         "messages", "messages[0].name is not taken"),
        ({"messages": [{"role": "tool", "content": "a"}]}, "messages", "role 'tool' is not taken"),
        ({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": GOOD, "detail": "high"}}]}]},
         "messages", "image_url.detail 'high' is not taken"),
        ({"messages": [{"role": "user", "content": []}]}, "messages", "non-empty list of parts"),
        ({"messages": []}, "messages", "messages is empty"),
        ({"messages": image_message(GOOD), "input": "a"}, "messages", "not both"),
        ({"messages": image_message(GOOD), "chat_template": "{{x}}"}, "chat_template",
         "own chat template is not taken"),
        ({"messages": image_message(GOOD), "add_generation_prompt": True},
         "add_generation_prompt", "a dual encoder renders no chat template"),
        ({"messages": image_message(GOOD), "chat_template_kwargs": {"x": 1}},
         "chat_template_kwargs", "a dual encoder renders no chat template"),
        ({"messages": image_message(GOOD), "mm_processor_kwargs": {"size": 3}},
         "mm_processor_kwargs", "no per-request overrides"),
        ({"messages": text_message("a"), "add_special_tokens": True}, "add_special_tokens",
         "not taken with messages"),
        ({"messages": text_message("a"), "outputs": ["dense", "sparse"]}, None, None),
        ({"messages": image_message(GOOD), "late_chunking": True}, "messages",
         "messages are taken for embeddings"),
        ({"messages": image_message(GOOD), "truncate_prompt_tokens": 4},
         "truncate_prompt_tokens", "applies to texts"),
        ({"messages": image_message(GOOD), "long_inputs": "chunk"}, "long_inputs",
         "applies to texts"),
        ({"messages": image_message(GOOD), "request_id": "x"}, None,
         "Unrecognized request argument supplied: request_id"),
        ({"messages": image_message(data_uri(b"junk"))}, "messages",
         "messages[0].content[0].image_url.url: not a decodable image"),
        ({"messages": text_message("a <|endoftext|>")}, "messages",
         "messages[0].content[0].text:"),
        ({}, "input", "input is required"),
    ],
)  # fmt: skip
def test_messages_refusals_name_the_field(server, body, param, says):
    r = post(server, "/v1/embeddings", **body)
    if says is None:  # a 4xx naming the outputs the model lacks; never a 200 that ignores them
        assert 400 <= r.status_code < 500, r.text
        return
    assert_error(r, 400, "invalid_request_error", param=param, says=says)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        (data_uri(b"junk bytes, no image"), "image_url.url: not a decodable image"),
        (data_uri(png_header(30_000, 30_000)), "image_url.url: the image is over the limit"),
        ("http://example.com/cat.png", "image_url.url is a remote URL"),
        ("https://10.255.255.1:9/unreachable.png", "image_url.url is a remote URL"),
    ],
)
def test_bad_message_images_are_fast_400s_while_others_are_answered(server, url, says):
    """Bad images in flight beside good requests of other clients: each bad one a 400 in
    under a second, every good one answered, the server's memory flat."""
    good = {"messages": image_message(GOOD)}
    assert post(server, "/v1/embeddings", **good).status_code == 200  # warm
    before = rss_kib(server.proc.pid)
    stop = threading.Event()
    answered: list[int] = []

    def other_client() -> None:
        while not stop.is_set():
            answered.append(post(server, "/v1/embeddings", **good).status_code)

    with ThreadPoolExecutor(2) as pool:
        others = [pool.submit(other_client) for _ in range(2)]
        try:
            for _ in range(5):
                start = time.monotonic()
                r = post(server, "/v1/embeddings", messages=image_message(url))
                assert time.monotonic() - start < 1.0
                assert_error(r, 400, "invalid_request_error", param="messages",
                             says=f"messages[0].content[0].{says}")  # fmt: skip
        finally:
            stop.set()
        for other in others:
            other.result()
    assert answered and set(answered) == {200}
    assert rss_kib(server.proc.pid) - before < 8 * 1024


# -- batch lines with images: the Batch API and run-batch ----------------------------------------


def batch_bodies(media: Path, host: str) -> dict[str, list[dict]]:
    """Bodies per route, as the online routes take them: images as data URIs, files and URLs
    of an allowed host, texts, and bad images."""
    images = [data_uri(png_bytes(image)) for image in sample_images()[:3]]
    return {
        "/v1/embeddings": [
            {"messages": image_message(images[0])},
            {"messages": image_message(f"file://{media / 'cat.png'}"), "encoding_format": "base64"},
            {"messages": text_message("a photo of a cat")},
            {"messages": image_message(data_uri(b"junk"))},
            {"messages": image_message(host + "/cat.png")},
            {"messages": image_message(host + "/missing.png")},
        ],
        "/v2/embed": [
            {"input_type": "image", "images": images[1:], "embedding_types": ["float"]},
            {"input_type": "image", "images": [images[0], data_uri(png_header(30_000, 30_000))]},
        ],
    }


def batch_file(bodies: dict[str, list[dict]], route: str | None = None) -> bytes:
    lines = [
        {"custom_id": f"{url}-{i}", "method": "POST", "url": url, "body": body}
        for url, some in bodies.items() if route in (None, url)
        for i, body in enumerate(some)
    ]  # fmt: skip
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def assert_answered_as_online(server: ServerProcess, bodies, lines: list[dict]) -> None:
    """Each output line holds what the online route answers its body: the status, the
    vectors (cosine), the error."""
    out = {line["custom_id"]: line["response"] for line in lines}
    seen = 0
    for url, some in bodies.items():
        for i, body in enumerate(some):
            if f"{url}-{i}" not in out:
                continue
            seen += 1
            got, online = out[f"{url}-{i}"], httpx.post(server.url + url, json=body, timeout=60)
            assert got["status_code"] == online.status_code, (url, i, got)
            want = online.json()
            if online.status_code != 200:
                assert got["body"]["error"] == want["error"]
            elif url == "/v2/embed":
                a, b = got["body"]["embeddings"]["float"], want["embeddings"]["float"]
                assert float(cosine(np.array(a), np.array(b)).min()) >= MIN_COSINE
            else:
                a, b = got["body"]["data"][0]["embedding"], want["data"][0]["embedding"]
                if isinstance(a, str):
                    a, b = (np.frombuffer(base64.b64decode(x), "<f4")[None] for x in (a, b))
                assert float(cosine(np.array(a), np.array(b)).min()) >= MIN_COSINE
    assert seen == len(lines)


@pytest.mark.parametrize("route", ["/v1/embeddings", "/v2/embed"])
def test_batch_api_lines_with_images_answer_as_online(server, media, image_host, route):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    bodies = batch_bodies(media, image_host)
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
    assert len(lines) == len(bodies[route])
    assert_answered_as_online(server, bodies, lines)


def test_run_batch_lines_with_images_answer_as_online(
    server, clip_path, media, image_host, tmp_path
):
    bodies = batch_bodies(media, image_host)
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(batch_file(bodies))
    command = [sys.executable, "-m", "pipepool", "run-batch", "-i", str(source)]
    command += ["-o", str(output), "--model", str(clip_path)]
    command += ["--allowed-local-media-path", str(media), "--allowed-media-domains", "127.0.0.1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [json.loads(x) for x in output.read_bytes().splitlines()]
    assert len(lines) == sum(len(b) for b in bodies.values())
    assert_answered_as_online(server, bodies, lines)
