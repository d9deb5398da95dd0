"""Issue 35: one server, several models. A real ``pipepool serve`` of three models (the bundled
MiniLM embedder, a BERT cross-encoder and a Qwen3 sequence classifier whose prompts chunk),
each in processes of its own: routing by ``model``, answers equal to each model's own engine,
per-model queues, health and metrics, and a model killed under load healing alone. Plus the
memory plan's arithmetic and the command line's refusals."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from test_server import ServerProcess
from tiny_models import MIN_COSINE, SENTENCES, cosine, long_prompts

import pipepool
from pipepool.config import EngineConfig
from pipepool.errors import InvalidInputError
from pipepool.intake.tokenizer import OFFLOAD_CHARS
from pipepool.intake.tokenizer_process import helper_threads
from pipepool.loading.deployment import ModelMemory
from pipepool.replicas.memory_plan import MemoryPlanError, plan_memory, share_memory

# Slow: real `pipepool serve` processes of three models.
pytestmark = pytest.mark.slow

QUEUE = 64  # the classifier's own queue (the others': the server's 512)
INPUTS = 32  # --max-inputs-per-request
BUDGET = 16  # the classifier's step budget: its long prompts take several steps


@pytest.fixture(scope="module")
def classifier_path(model_dir):
    import tiny_models

    return tiny_models.make_decoder_classifier(model_dir / "multi-classifier", "qwen3")


@pytest.fixture(scope="module")
def server(tmp_path_factory, minilm_path, cross_encoder_path, classifier_path):
    root = tmp_path_factory.mktemp("multi")
    models_file = root / "models.toml"
    models_file.write_text(
        "[models.classifier]\n"
        f'model = "{classifier_path}"\n'
        'aliases = ["clf"]\n'
        'tasks = ["classify"]\n'
        f"max_queued_requests = {QUEUE}\n"
        f"max_num_batched_tokens = {BUDGET}\n"
    )
    args = [
        "--model", f"embedder={minilm_path}",
        "--model", f"reranker={cross_encoder_path}",
        "--models-file", str(models_file),
        "--device", "cpu",
        "--max-inputs-per-request", str(INPUTS),
        "--max-queued-requests", "512",
        "--queue-wait", "0",  # the flood's test counts 429s: refused at once
        "--state-dir", str(root / "state"),
    ]  # fmt: skip
    proc = ServerProcess(args, root / "server.log").wait_ready(timeout=180)
    yield proc
    proc.proc.send_signal(signal.SIGTERM)
    try:
        proc.proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.proc.kill()
        raise


@pytest.fixture(scope="module")
def engines(minilm_path, cross_encoder_path, classifier_path):
    """Each model's own engine: what a server of that model alone answers."""
    made = {
        "embedder": pipepool.Engine(str(minilm_path), device="cpu"),
        "reranker": pipepool.Engine(str(cross_encoder_path), device="cpu"),
        "classifier": pipepool.Engine(
            str(classifier_path), device="cpu", max_num_batched_tokens=BUDGET
        ),
    }
    yield made
    for engine in made.values():
        engine.close()


TEXTS = [*SENTENCES[:3], *long_prompts()[1:4]]


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def test_models_lists_three_with_their_tasks(server):
    data = httpx.get(server.url + "/v1/models").json()["data"]
    roots = {card["id"]: card["root"] for card in data}
    assert set(roots.values()) == {"embedder", "reranker", "classifier"}
    assert roots["clf"] == "classifier"  # an alias
    tasks = {card["id"]: card["tasks"] for card in data}
    assert tasks["embedder"] == ["embed"]
    assert tasks["reranker"] == ["score", "rerank", "classify"]
    assert tasks["classifier"] == ["classify"]  # offered for classify only


def test_model_cards_read_by_the_openai_and_cohere_clients(server, minilm_path):
    import cohere
    import openai

    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    assert {m.id for m in oa.models.list()} >= {"embedder", "reranker", "classifier", "clf"}
    card = oa.models.retrieve("clf")
    assert (card.id, card.owned_by, card.model_extra["root"]) == ("clf", "pipepool", "classifier")
    # A name no model answers to (a folder given a name is not one) is OpenAI's 404.
    assert httpx.get(f"{server.url}/v1/models/{minilm_path}").status_code == 404
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oa.models.retrieve("nope")

    co = cohere.Client(base_url=server.url, api_key="unused")
    got = co.models.get("reranker")
    assert (got.name, sorted(got.endpoints), got.default_endpoints) == (
        "reranker",
        ["classify", "rerank"],
        ["rerank"],  # classify has two models here: a request naming none must name one
    )
    assert (
        got.context_length
        == httpx.get(server.url + "/v1/models").json()["data"][1]["max_model_len"]
    )
    assert {m.name for m in co.models.list(endpoint="embed").models} == {"embedder"}
    assert {m.name for m in co.models.list(endpoint="classify").models} == {
        "reranker",
        "classifier",
        "clf",
    }
    assert co.models.list(endpoint="classify", default_only=True).models == []
    assert co.models.list(endpoint="chat").models == []  # Cohere's, but no model here chats
    # Pages: every card once, in order, then no next page.
    names, token = [], None
    while True:
        page = co.models.list(page_size=2, page_token=token)
        names += [m.name for m in page.models]
        token = page.next_page_token
        if token is None:
            break
    assert names == [c["id"] for c in httpx.get(server.url + "/v1/models").json()["data"]]
    for query, param in [
        ("endpoint=translate", "endpoint"),
        ("page_size=2.5", "page_size"),
        ("default_only=true", "default_only"),
        ("page_size=0", "page_size"),
        ("page_token=x", "page_token"),
    ]:
        r = httpx.get(f"{server.url}/v1/models?{query}")
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_each_route_answers_as_its_model_alone(server, engines):
    out = _post(server, "/v1/embeddings", {"model": "embedder", "input": TEXTS}).json()
    assert out["model"] == "embedder"
    expected = engines["embedder"].embed(TEXTS)
    for row, want in zip(out["data"], expected, strict=True):
        assert cosine(np.array(row["embedding"]), want) >= MIN_COSINE

    docs = TEXTS[1:]
    out = _post(server, "/rerank", {"model": "reranker", "query": TEXTS[0], "documents": docs})
    want = engines["reranker"].score([TEXTS[0]] * len(docs), docs)
    for r in out.json()["results"]:
        assert abs(r["relevance_score"] - float(want[r["index"]])) <= 1e-5

    out = _post(server, "/classify", {"model": "clf", "input": TEXTS}).json()
    assert out["model"] == "clf"
    want = engines["classifier"].classify(TEXTS).probs
    for row, probs in zip(out["data"], want, strict=True):
        assert np.allclose(row["probs"], probs, atol=1e-5)


def test_pooling_runs_each_model_s_own_task_as_vllm_does(server, engines):
    """vLLM's /pooling without task: a classifier's is classify (label probabilities per
    input); a cross-encoder with one label classifies too; the embedder's tasks are named
    when it is asked for another."""
    for name, root in (("clf", "classifier"), ("reranker", "reranker")):
        out = _post(server, "/pooling", {"model": name, "input": TEXTS}).json()
        assert out["model"] == name and out["id"].startswith("pooling-")
        want = engines[root].classify(TEXTS).probs
        for row, probs in zip(out["data"], want, strict=True):
            assert np.allclose(row["data"], probs, atol=1e-5)
        again = _post(server, "/pooling", {"model": name, "input": TEXTS, "task": "classify"})
        assert again.json()["data"] == out["data"]
        body = {"model": name, "input": TEXTS, "use_activation": False}  # vLLM's: raw logits
        logits = _post(server, "/pooling", body).json()["data"]
        want = engines[root].classify(TEXTS, use_activation=False).probs
        for row, expected in zip(logits, want, strict=True):
            assert np.allclose(row["data"], expected, atol=1e-5)
    long_text = " ".join(TEXTS * 4)
    sides = {}
    for side in ("left", "right"):  # vLLM's truncation_side, as Engine.classify honours it
        body = {"model": "clf", "input": [long_text], "truncate_prompt_tokens": 6,
                "truncation_side": side}  # fmt: skip
        got = _post(server, "/pooling", body).json()["data"][0]["data"]
        want = (
            engines["classifier"]
            .classify([long_text], truncate_prompt_tokens=6, truncation_side=side)
            .probs[0]
        )
        assert np.allclose(got, want, atol=1e-5), side
        sides[side] = got
    assert not np.allclose(sides["left"], sides["right"], atol=1e-5), "the side changed nothing"
    r = _post(server, "/pooling", {"model": "clf", "input": "x", "task": "embed"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "task"
    assert r.json()["error"]["message"].endswith("its tasks: classify")
    r = _post(server, "/pooling", {"model": "clf", "input": "x", "normalize": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "normalize"


def test_large_batches_go_to_each_models_tokenizer_process_and_answer_as_alone(server, engines):
    children = _children(server.proc.pid)
    helpers = [pid for pid, line in children if b"pipepool.intake.tokenizer_process" in line]
    assert len(helpers) == 3  # one per model
    big = [long_prompts()[i] for i in (3, 7, 2)] * 8
    assert sum(map(len, big)) >= OFFLOAD_CHARS  # tokenised in the helper (test_tokenizer_process)
    out = _post(server, "/v1/embeddings", {"model": "embedder", "input": big}).json()
    for row, want in zip(out["data"], engines["embedder"].embed(big), strict=True):
        assert cosine(np.array(row["embedding"]), want) >= MIN_COSINE
    out = _post(server, "/rerank", {"model": "reranker", "query": TEXTS[0], "documents": big})
    want = engines["reranker"].score([TEXTS[0]] * len(big), big)
    for r in out.json()["results"]:
        assert abs(r["relevance_score"] - float(want[r["index"]])) <= 1e-5
    # Their encoding pools: half the cores between one model's helpers (one front end here).
    pools = os.environ.get("RAYON_NUM_THREADS", str(helper_threads(1))).encode()
    for pid in helpers:
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert b"RAYON_NUM_THREADS=" + pools in f.read().split(b"\0")


def _children(pid: int) -> list[tuple[int, bytes]]:
    """The pid and command line of each of a process's children."""
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                parent = int(f.read().rsplit(b")", 1)[1].split()[1])
            if parent == pid:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    out.append((int(entry), f.read()))
        except (OSError, ValueError):
            continue
    return out


def test_a_request_without_model_goes_to_the_only_model_that_can_answer(server, engines):
    out = _post(server, "/v1/embeddings", {"input": TEXTS[:2]}).json()
    assert out["model"] == "embedder"
    out = _post(server, "/embed", {"inputs": TEXTS[:2]})  # TEI's route names no model
    assert out.status_code == 200 and len(out.json()) == 2
    out = _post(server, "/score", {"text_1": TEXTS[0], "text_2": TEXTS[1]}).json()
    assert out["model"] == "reranker"
    # Two models classify: the request must say which.
    r = _post(server, "/classify", {"input": "x"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "model_required" and error["param"] == "model"
    assert "reranker" in error["message"] and "classifier" in error["message"]


def test_unknown_model_and_wrong_task_are_404(server):
    r = _post(server, "/v1/embeddings", {"model": "nope", "input": "x"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    for name in ("embedder", "reranker", "classifier"):
        assert name in r.json()["error"]["message"]
    r = _post(server, "/rerank", {"model": "embedder", "query": "q", "documents": ["d"]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "unsupported_task"
    # The classifier can score nothing (three labels), and is not offered for what it can do
    # beyond classify: it cannot embed here.
    r = _post(server, "/v1/embeddings", {"model": "classifier", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "unsupported_task"


def test_the_server_routes_as_a_router_of_the_same_models(server, engines):
    """The shared rule (``api.routing.route``) over real HTTP: each case answered as a
    ``Router`` of the same models answers it, with the same message."""
    router = pipepool.Router.from_engines(engines)  # not closed: the engines are the module's
    cases = [
        ("/v1/embeddings", {"model": "nope", "input": "x"},
         lambda: router.embed(["x"], model="nope"), 404, "model_not_found"),
        ("/classify", {"input": "x"}, lambda: router.classify(["x"]), 400, "model_required"),
        ("/v1/embeddings", {"input": "x", "outputs": ["sparse"]},
         lambda: router.embed_sparse(["x"]), 404, "unsupported_task"),
    ]  # fmt: skip
    for path, body, call, status, code in cases:
        r = _post(server, path, body)
        error = r.json()["error"]
        assert (r.status_code, error["code"], error["param"]) == (status, code, "model")
        with pytest.raises(InvalidInputError) as e:
            call()
        if code != "model_not_found":  # the server's 404 keeps OpenAI's wording
            assert error["message"] == str(e.value)
    out = _post(server, "/v1/embeddings", {"input": "x"}).json()
    assert router.engine(task="embed") is engines[out["model"]]
    # vLLM's /pooling: its task, where given, is what the model must do.
    out = _post(server, "/pooling", {"input": "x", "task": "embed"}).json()
    assert out["model"] == "embedder"
    r = _post(server, "/pooling", {"input": "x"})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "model_required")


def test_health_and_metrics_per_model(server):
    body = httpx.get(server.url + "/health").json()
    assert body["status"] == "ok"
    assert set(body["models"]) == {"embedder", "reranker", "classifier"}
    one = httpx.get(server.url + "/health", params={"model": "clf"})
    assert one.status_code == 200 and one.json()["status"] == "ok"
    missing = httpx.get(server.url + "/health", params={"model": "nope"})
    assert missing.status_code == 404
    _post(server, "/v1/embeddings", {"model": "embedder", "input": "count me"})
    m = server.metrics()
    for name in ("embedder", "reranker", "classifier"):
        assert m[f'pipepool_engine_ready{{model="{name}"}}'] == 1
    assert m['pipepool_server_max_queued_requests{model="classifier"}'] == QUEUE
    assert m['pipepool_server_max_queued_requests{model="embedder"}'] == 512
    key = 'pipepool_http_requests_total{route="/v1/embeddings",status="200",model="embedder"}'
    assert m[key] >= 1


def test_a_flood_on_one_model_is_429_for_that_model_only(server):
    flood = {"model": "classifier", "input": [TEXTS[0]] * INPUTS}
    other = {"model": "embedder", "input": TEXTS[:2]}
    with ThreadPoolExecutor(24) as pool:
        floods = [pool.submit(_post, server, "/classify", flood) for _ in range(16)]
        others = [pool.submit(_post, server, "/v1/embeddings", other) for _ in range(8)]
        flooded = [f.result().status_code for f in floods]
        served = [f.result().status_code for f in others]
    assert 429 in flooded and set(flooded) <= {200, 429}
    assert served == [200] * len(served)


def test_a_killed_model_heals_alone_and_loses_no_request(server, engines):
    pid = _replica_pid(server, "classifier")
    stop = threading.Event()
    answers: dict[str, list[int]] = {"embedder": [], "reranker": [], "classifier": []}

    def load(name: str, path: str, body: dict) -> None:
        while not stop.is_set():
            answers[name].append(_post(server, path, body).status_code)

    bodies = {
        "embedder": ("/v1/embeddings", {"model": "embedder", "input": TEXTS}),
        "reranker": ("/score", {"model": "reranker", "text_1": TEXTS[0], "text_2": TEXTS[1:]}),
        "classifier": ("/classify", {"model": "classifier", "input": TEXTS}),
    }
    threads = [
        threading.Thread(target=load, args=(name, *bodies[name])) for name in bodies for _ in (0, 1)
    ]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)  # under load: requests in flight on every model
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        health_codes, ready = set(), set()  # the server's /health; the classifier's readiness
        while _replica_pid(server, "classifier") in (pid, None):
            assert time.monotonic() < deadline, "the classifier did not come back"
            health_codes.add(httpx.get(server.url + "/health").status_code)
            ready.add(httpx.get(server.url + "/v2/models/classifier/ready").status_code)
        back = len(answers["classifier"])
        while len(answers["classifier"]) < back + 2:  # answered by the new process
            assert time.monotonic() < deadline, "the classifier answers nothing"
            time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert set(answers["embedder"]) == {200} and set(answers["reranker"]) == {200}
    # The others served on: the server stayed healthy for a load balancer, the classifier's
    # own readiness said it was not serving while it restarted.
    assert health_codes == {200} and 503 in ready
    # The killed model's requests waited for its restart (or, if they could not, a clear 503).
    assert set(answers["classifier"]) <= {200, 503}
    assert answers["classifier"].count(200) >= 2
    m = server.metrics()
    assert m['pipepool_replica_restarts_total{model="classifier",replica="0"}'] >= 1
    assert m['pipepool_replica_restarts_total{model="embedder",replica="0"}'] == 0
    out = _post(server, "/classify", {"model": "classifier", "input": TEXTS}).json()
    want = engines["classifier"].classify(TEXTS).probs
    for row, probs in zip(out["data"], want, strict=True):
        assert np.allclose(row["probs"], probs, atol=1e-5)


def _replica_pid(server, model: str) -> int | None:
    """The pid of ``model``'s replica process, from ``pipepool_replica_info``."""
    for key, value in server.metrics().items():
        if key.startswith("pipepool_replica_info{") and f'model="{model}"' in key and value:
            pid = key.split('pid="', 1)[1].split('"', 1)[0]
            return int(pid) if pid else None
    return None


# -- the memory plan -------------------------------------------------------------------------

_GIB = 1 << 30


def _memory(weights_gib: float, kv_per_token: int = 0, least: int = 0) -> ModelMemory:
    return ModelMemory(
        weights=int(weights_gib * _GIB),
        activations=_GIB // 2,
        overhead=_GIB,
        kv_bytes_per_token=kv_per_token,
        min_kv_tokens=least,
        kv_cache_tokens=None,
    )


def test_memory_plan_gives_causal_models_equal_shares_of_what_is_left():
    config = EngineConfig()
    needs = [
        ("encoder", config, _memory(1.0), ("cuda:0",)),
        ("decoder-a", config, _memory(2.0, kv_per_token=1 << 20, least=1024), ("cuda:0",)),
        ("decoder-b", config, _memory(2.0, kv_per_token=1 << 19, least=1024), ("cuda:0",)),
    ]
    plan = share_memory("cuda", {"cuda:0": 40 * _GIB}, needs)
    fixed = (1.0 + 2.0 + 2.0 + 3 * 1.5) * _GIB
    least = 1024 * (1 << 20) + 1024 * (1 << 19)
    left = 40 * _GIB - fixed - least
    a, b = plan.models[1], plan.models[2]
    assert a.kv_tokens == 1024 + (left // 2) // (1 << 20)
    assert b.kv_tokens == 1024 + (left // 2) // (1 << 19)
    assert a.config.kv_cache_tokens == a.kv_tokens  # what its replica process will allocate
    assert plan.models[0].kv_tokens == 0 and plan.models[0].config.kv_cache_tokens is None
    assert 0 <= 40 * _GIB - plan.used("cuda:0") < 2 * (1 << 20)
    assert "decoder-a" in plan.describe()


def test_memory_plan_that_does_not_fit_is_refused_with_its_numbers(minilm_path):
    configs = [(name, EngineConfig(model=str(minilm_path), device="cpu")) for name in "ab"]
    plan = plan_memory(configs, capacity={"cpu": 64 * _GIB})
    assert [m.name for m in plan.models] == ["a", "b"]
    assert plan.models[0].memory.weights > 0
    with pytest.raises(MemoryPlanError, match=r"do not fit cpu: they need [\d.]+ GiB of 0.50"):
        plan_memory(configs, capacity={"cpu": _GIB // 2})


# -- the command line --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "file", "expected"),
    [
        (["--model", "a={m}", "--model", "a={m}"], None, "two models answer to the name 'a'"),
        (["--model", "{m}", "--model", "b={m}", "--served-model-name", "x"], None,
         "--served-model-name names the one model"),
        (["--model", "a={m}"], "[models.b]\nmodel = '{m}'\ncolour = 'red'\n",
         "unknown option(s) colour"),
        ([], "[models.b]\naliases = ['c']\n", "needs model = \"PATH\""),
        (["--model", "a={m}"], "[models.b]\nmodel = '{m}'\nmax_queued_requests = 3\n",
         "max_queued_requests=3 must be an integer of at least"),
    ],
)  # fmt: skip
def test_serve_refuses_ambiguous_or_unknown_model_options(
    tmp_path, minilm_path, capsys, args, file, expected
):
    from pipepool.commands.cli import main

    argv = [a.format(m=minilm_path) for a in args]
    if file is not None:
        (tmp_path / "models.toml").write_text(file.format(m=minilm_path))
        argv += ["--models-file", str(tmp_path / "models.toml")]
    # In this process: each is refused before anything loads or listens.
    assert main(["serve", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert expected in err, err
    assert "ready: model" not in err


def test_model_names_are_checked_when_the_server_is_built():
    from pipepool.server.models import ModelNames

    with pytest.raises(InvalidInputError, match="unknown task 'embedd'"):
        ModelNames(("a",), tasks=("embedd",))
