"""Vision-language embedders where the server runs its pipelines in replica processes: a tiny
Qwen2-VL with ``--api-server-count 2`` (both front-end processes format, decode and
preprocess texts with images, vLLM's ``messages`` and Cohere's ``inputs``, and send them,
media rows and images along, to the replica: the vectors of ``Engine.embed`` of the same
inputs), a call split between ``data_parallel_size`` replicas, and the other families over
HTTP (a Qwen3-VL conversation, ColPali's pages): each as the Python API computes it."""

from __future__ import annotations

import base64
import signal
import subprocess

import httpx
import numpy as np
import pytest
from test_server import ServerProcess, wait_for
from test_server_limits import assert_error
from test_vlm_server import IMAGES, PNGS, data_uri, image_part, page, post, text_part, vector
from tiny_colpali import make_colpali
from tiny_models import MIN_COSINE, cosine
from tiny_towers import png_bytes, sample_images
from tiny_vlm import make_qwen2_vl, make_qwen3_vl

import pipepool

# Slow: a real `pipepool serve` of several API server processes.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vlm_path(model_dir):
    return make_qwen2_vl(model_dir / "qwen2_vl-api-servers")


@pytest.fixture(scope="module")
def server(tmp_path_factory, vlm_path):
    root = tmp_path_factory.mktemp("vlm-api")
    args = ["--model", f"vlm={vlm_path}", "--api-server-count", "2", "--no-access-log"]
    proc = ServerProcess(args, root / "server.log").wait_ready(timeout=240)
    try:
        wait_for(lambda: "with 2 API server processes" in proc.log(), timeout=120,
                 what="the second API server")  # fmt: skip
        yield proc
    finally:
        proc.proc.send_signal(signal.SIGTERM)
        try:
            proc.proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.proc.kill()
            raise


def _image_part(image) -> dict:
    uri = "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
    return {"type": "image_url", "image_url": {"url": uri}}


def test_both_front_ends_embed_texts_with_images(server, vlm_path):
    images = sample_images()
    items = [{"text": "a cat", "image": images[0]}, {"text": "two", "images": images[1:3]}]
    with pipepool.Engine(str(vlm_path), device="cpu") as engine:
        want = engine.embed(items)
    text = {"type": "text", "text": "a cat"}
    messages = [{"role": "user", "content": [_image_part(images[0]), text]}]
    inputs = [
        {"content": [_image_part(images[0]), text]},
        {"content": [_image_part(images[1]), _image_part(images[2]),
                     {"type": "text", "text": "two"}]},
    ]  # fmt: skip
    seen: set[int] = set()
    for _ in range(200):  # a connection per try: the kernel hands each to one process
        with httpx.Client(base_url=server.url, timeout=60) as http:
            which = http.get("/health").json()["api_server"]
            if which in seen:
                continue
            seen.add(which)
            body = {"model": "vlm", "messages": messages, "add_generation_prompt": True}
            r = http.post("/v1/embeddings", json=body)
            assert r.status_code == 200, (which, r.text)
            got = np.array([r.json()["data"][0]["embedding"]], dtype=np.float32)
            assert float(cosine(got, want[:1]).min()) >= MIN_COSINE, which
            body = {"model": "vlm", "inputs": inputs, "input_type": "search_document"}
            r = http.post("/v2/embed", json=body)
            assert r.status_code == 200, (which, r.text)
            got = np.array(r.json()["embeddings"]["float"], dtype=np.float32)
            assert float(cosine(got, want).min()) >= MIN_COSINE, which
        if seen == {0, 1}:
            break
    assert seen == {0, 1}


def test_data_parallel_replicas_split_texts_with_images(vlm_path):
    """data_parallel_size 2: a call's prompts split between the replicas, each prompt's media
    rows and images with it; the vectors of one pipeline."""
    images = sample_images()
    items = [{"text": f"page {i}", "images": images[i % 5 : i % 5 + 1 + i % 2]} for i in range(8)]
    with pipepool.Engine(str(vlm_path), device="cpu") as engine:
        want = engine.embed(items)
    # batches of at most 32 tokens: the call's rows split between the two replicas
    dp = pipepool.Engine(str(vlm_path), device="cpu", data_parallel_size=2,
                         max_num_batched_tokens=32)  # fmt: skip
    with dp as engine:
        pipeline, sent = engine.pipeline, []
        assign = pipeline._assign
        pipeline._assign = lambda slot, *rest: (sent.append(slot.index), assign(slot, *rest))
        got = engine.embed(items)
    assert sorted(set(sent)) == [0, 1]
    assert float(cosine(got, want).min()) >= MIN_COSINE


@pytest.fixture(scope="module")
def families(model_dir, tmp_path_factory):
    """A server of a tiny Qwen3-VL and a tiny ColPali, and their folders."""
    paths = {
        "qwen3_vl": make_qwen3_vl(model_dir / "qwen3_vl-http"),
        "colpali": make_colpali(model_dir / "colpali-http"),
    }
    args = [arg for name, path in paths.items() for arg in ("--model", f"{name}={path}")]
    proc = ServerProcess(args, tmp_path_factory.mktemp("vlm-families") / "serve.log")
    try:
        yield proc.wait_ready(timeout=240), paths
    finally:
        proc.stop()


def test_qwen3_vl_and_colpali(families):
    """The other families of each kind: a Qwen3-VL conversation equals ``Engine.embed`` of
    its dict input; ColPali's pages rerank as ``Engine.rerank`` ranks them, and its
    conversations are refused by name where a chat template would be rendered."""
    server, paths = families
    item = {"text": "a cat", "image": IMAGES[0]}
    messages = [{"role": "user", "content": [image_part(data_uri(PNGS[0])), text_part("a cat")]}]
    r = post(server, "/v1/embeddings", model="qwen3_vl", messages=messages,
             add_generation_prompt=True)  # fmt: skip
    with pipepool.Engine(str(paths["qwen3_vl"])) as engine:
        want = engine.embed([item])
    assert float(cosine(vector(r), want)[0]) >= MIN_COSINE
    query, pages = "a chart", [page(PNGS[i]) for i in range(3)]
    r = post(server, "/rerank", model="colpali", query=query, documents=pages)
    assert r.status_code == 200, r.text
    with pipepool.Engine(str(paths["colpali"])) as engine:
        ranked = engine.rerank(query, IMAGES[:3])
    assert [x["index"] for x in r.json()["results"]] == [x.index for x in ranked]
    np.testing.assert_allclose([x["relevance_score"] for x in r.json()["results"]],
                               [x.relevance_score for x in ranked], rtol=1e-5)  # fmt: skip
    r = post(server, "/pooling", model="colpali", messages=messages)
    assert_error(r, 400, "invalid_request_error", param="messages", says="ColPali embeds a query")
    r = post(server, "/v1/embeddings", model="colpali", input=["x"])
    assert_error(r, 400, "invalid_request_error", param="model", says="ColPali, a page retriever")
