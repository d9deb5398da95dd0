"""/health, the per-model readiness route and /metrics of a server of several models, one of
which does not serve (still loading, or failed), and a component check that fails; and the
``Connection: close`` of a 500. A real server in this process (the app behind uvicorn and the
connection guards, on a real port), so that a test can make a component fail or a route raise;
a model restarting in a server of processes is in test_multi_model.py."""

from __future__ import annotations

import http.client
import threading
from types import SimpleNamespace

import httpx
import pytest
from prometheus_text import assert_valid_and_unique
from test_server import _free_port

import pipepool
from pipepool.errors import ModelLoadError
from pipepool.server import metrics
from pipepool.server.front import AsyncEngine
from pipepool.server.health import ComponentHealth
from pipepool.server.models import ModelNames, ServedModel, ServedModels
from pipepool.server.owner import EngineOwner
from pipepool.server.settings import ServerSettings
from pipepool.server.uvicorn_server import build_server

# Slow: several models' engines, a stage killed.
pytestmark = pytest.mark.slow

KEY = "sesame"


def _failed_load() -> pipepool.Engine:
    raise ModelLoadError("no weights")


@pytest.fixture(scope="module")
def server(qwen3_path, tmp_path_factory):
    """Three models: ``serving`` (the tiny Qwen3, loaded), ``loading`` (never loads) and
    ``broken`` (its load failed); an API key; a component check the test sets (``probe``)."""
    serving = EngineOwner(lambda: pipepool.Engine(str(qwen3_path), device="cpu"))
    broken = EngineOwner(_failed_load)
    for owner in (serving, broken):
        owner.start(on_failure=lambda exc: None)
        owner.loaded.wait()
    fronts = {
        "serving": AsyncEngine(serving, max_queued=16),
        "loading": AsyncEngine(EngineOwner(lambda: None), max_queued=16),  # never started
        "broken": AsyncEngine(broken, max_queued=16),
    }
    models = ServedModels([ServedModel(ModelNames((n,)), f) for n, f in fronts.items()])
    port = _free_port()
    state_dir = tmp_path_factory.mktemp("health-state")
    settings = ServerSettings(port=port, api_key=KEY, state_dir=str(state_dir))
    started = threading.Event()
    uvicorn_server = build_server(settings, models, logs=None, on_started=started.set)
    probe = {"health": ComponentHealth(ok=True)}
    uvicorn_server.config.app.state.pipepool.checks.add("probe", lambda: probe["health"])
    thread = threading.Thread(target=uvicorn_server.run, name="health-server")
    thread.start()
    try:
        assert started.wait(60), "the in-process server did not start"
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", port=port, probe=probe)
    finally:
        uvicorn_server.should_exit = True
        thread.join()
        for front in fronts.values():
            front.close()
        serving.close()


def test_health_is_200_while_any_model_serves_with_each_models_status(server):
    r = httpx.get(server.url + "/health")  # no key: probes need none
    assert r.status_code == 200
    assert r.json() == {
        "status": "degraded",
        "models": {
            "serving": {"status": "ok"},
            "loading": {"status": "loading"},
            "broken": {"status": "failed"},
        },
    }
    one = httpx.get(server.url + "/health", params={"model": "loading"})
    assert one.status_code == 503 and one.json() == {"status": "loading"}
    assert httpx.get(server.url + "/health", params={"model": "serving"}).status_code == 200


@pytest.mark.parametrize(
    ("model", "code", "status"),
    [("serving", 200, "ok"), ("loading", 503, "loading"), ("broken", 503, "failed")],
)
def test_each_model_has_a_readiness_route_open_without_the_key(server, model, code, status):
    r = httpx.get(f"{server.url}/v2/models/{model}/ready")
    assert r.status_code == code
    assert r.json() == {"name": model, "ready": code == 200, "status": status}


def test_readiness_of_an_unknown_model_is_404_and_other_routes_keep_the_key(server):
    r = httpx.get(server.url + "/v2/models/nope/ready")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    refused = httpx.post(server.url + "/v1/embeddings", json={"model": "serving", "input": "x"})
    assert refused.status_code == 401
    served = httpx.post(
        server.url + "/v1/embeddings",
        json={"model": "serving", "input": "x"},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert served.status_code == 200


def test_a_failing_component_is_named_in_health_and_metrics(server):
    server.probe["health"] = ComponentHealth(ok=False, detail="disk full")
    try:
        r = httpx.get(server.url + "/health")
        assert r.status_code == 200
        assert r.json()["status"] == "degraded"
        assert r.json()["components"] == {"probe": {"status": "degraded", "detail": "disk full"}}
        text = httpx.get(server.url + "/metrics").text
        assert assert_valid_and_unique(text)[("pipepool_component_ok", _probe())] == 0
    finally:
        server.probe["health"] = ComponentHealth(ok=True)
    assert "components" not in httpx.get(server.url + "/health").json()
    text = httpx.get(server.url + "/metrics").text
    assert assert_valid_and_unique(text)[("pipepool_component_ok", _probe())] == 1


def _probe() -> frozenset:
    return frozenset({("component", "probe")})


def test_metrics_of_several_models_write_each_series_once(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    for model in ("serving", "loading", "nope"):
        httpx.post(
            server.url + "/v1/embeddings", json={"model": model, "input": "x"}, headers=headers
        )
    httpx.post(server.url + "/v1/embeddings", content=b"{", headers=headers)
    series = assert_valid_and_unique(httpx.get(server.url + "/metrics").text)
    for model in ("serving", "loading", "broken"):
        ready = series[("pipepool_engine_ready", frozenset({("model", model)}))]
        assert ready == (model == "serving")


def test_a_500_says_connection_close_and_the_keep_alive_client_goes_on(server, monkeypatch):
    """An unexpected exception is answered 500 and the connection closed after it (uvicorn
    does so): the answer says ``Connection: close``, so the client's next request opens a new
    connection instead of failing with a reset."""

    def broken_render(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(metrics, "render", broken_render)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        first = conn.getresponse()
        body = first.read()
        assert first.status == 500 and b"internal_error" in body
        assert first.getheader("Connection") == "close"
        assert conn.sock is None  # http.client heard it: the next request reconnects
        monkeypatch.undo()
        for _ in range(2):  # and keep-alive holds again after a healthy answer
            conn.request("GET", "/health")
            again = conn.getresponse()
            again.read()
            assert again.status == 200 and again.getheader("Connection") != "close"
    finally:
        conn.close()
