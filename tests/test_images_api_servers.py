"""Images where the server runs its models in replica processes: a tiny CLIP served beside
the bundled MiniLM (several models) with ``--api-server-count 2``. Both front-end processes
embed images (Cohere's ``images``, vLLM's ``messages``) through the vision tower's replicas,
with the vectors of one engine of both towers; the other model answers as before."""

from __future__ import annotations

import base64
import signal
import subprocess

import httpx
import numpy as np
import pytest
from test_server import ServerProcess, wait_for
from tiny_models import MIN_COSINE, cosine
from tiny_towers import make_clip, png_bytes, sample_images

import pipepool

# Slow: real `pipepool serve` processes of several models and API servers.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def clip_path(model_dir):
    return make_clip(model_dir / "clip-api-servers")


@pytest.fixture(scope="module")
def server(tmp_path_factory, clip_path, minilm_path):
    root = tmp_path_factory.mktemp("images-api")
    args = [
        "--model", f"clip={clip_path}",
        "--model", f"embedder={minilm_path}",
        "--device", "cpu",
        "--api-server-count", "2",
        "--no-access-log",
    ]  # fmt: skip
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


def _data_uri(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def test_both_front_ends_embed_images_through_the_vision_replicas(server, clip_path):
    images = sample_images()[:3]
    with pipepool.Engine(str(clip_path), device="cpu") as engine:
        want = engine.embed(images)
    seen: set[int] = set()
    for _ in range(200):  # a connection per try: the kernel hands each to one process
        with httpx.Client(base_url=server.url, timeout=60) as http:
            which = http.get("/health").json()["api_server"]
            if which in seen:
                continue
            seen.add(which)
            body = {"model": "clip", "input_type": "image", "images": list(map(_data_uri, images))}
            r = http.post("/v2/embed", json=body)
            assert r.status_code == 200, (which, r.text)
            got = np.array(r.json()["embeddings"]["float"], dtype=np.float32)
            assert float(cosine(got, want).min()) >= MIN_COSINE, which
            part = {"type": "image_url", "image_url": {"url": _data_uri(images[2])}}
            messages = [{"role": "user", "content": [part]}]
            r = http.post("/v1/embeddings", json={"model": "clip", "messages": messages})
            assert r.status_code == 200, (which, r.text)
            got = np.array([r.json()["data"][0]["embedding"]], dtype=np.float32)
            assert float(cosine(got, want[2:]).min()) >= MIN_COSINE, which
            r = http.post("/v1/embeddings", json={"model": "embedder", "input": "a text"})
            assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384
            r = http.post("/v1/embeddings", json={"model": "embedder", "messages": messages})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
            assert "messages are taken for dual encoders" in r.json()["error"]["message"]
        if seen == {0, 1}:
            break
    assert seen == {0, 1}
    plan = server.log()[server.log().index("memory plan") :]
    assert "clip:vision" in plan  # the vision tower's replicas are planned beside the others
