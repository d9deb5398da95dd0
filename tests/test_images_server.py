"""Images over HTTP: Cohere's ``POST /v2/embed`` ``images`` (data URIs) on a real
``pipepool serve`` of a tiny CLIP, through the official cohere v2 client: the same vectors as
``Engine.embed`` of the same images; junk bytes, a 30,000 x 30,000 PNG header and a remote
URL each a 400 naming the input in under a second, the server's memory unchanged, other
clients answered meanwhile."""

from __future__ import annotations

import base64
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from test_server import ServerProcess
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


@pytest.fixture(scope="module")
def server(clip_path, media, tmp_path_factory):
    log = tmp_path_factory.mktemp("images-server") / "serve.log"
    args = ["--model", str(clip_path), "--served-model-name", "clip"]
    s = ServerProcess([*args, "--allowed-local-media-path", str(media)], log)
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def embed(server: ServerProcess, **body) -> httpx.Response:
    body.setdefault("model", "clip")
    body.setdefault("input_type", "image")
    return httpx.post(server.url + "/v2/embed", json=body, timeout=60)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_cohere_client_images_equal_the_python_api(server, clip_path):
    import cohere

    images = sample_images()
    client = cohere.ClientV2(base_url=server.url, api_key="unused")
    answer = client.embed(
        model="clip", input_type="image", embedding_types=["float"],
        images=[data_uri(png_bytes(image)) for image in images],
    )  # fmt: skip
    got = np.array(answer.embeddings.float_, dtype=np.float32)
    with pipepool.Engine(str(clip_path)) as engine:
        want = engine.embed(images)
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
        ("https://example.com/cat.png", "images[1] is a remote URL"),
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
