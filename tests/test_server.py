"""Issue 5 acceptance: a real ``pipepool serve`` process (PP=1 and PP=2) called with the
official openai client and raw HTTP; results equal Engine.embed on the same inputs."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from prometheus_text import assert_valid_and_unique
from tiny_models import MIN_COSINE, SENTENCES, cosine, long_prompts
from tokenizers import Tokenizer

import pipepool

# Slow: real `pipepool serve` processes at PP=1 and PP=2, stages killed under load.
pytestmark = pytest.mark.slow

MODEL = "tiny-qwen3"
BUDGET = 32  # small, so that long prompts always take several steps
SHUTDOWN_S = 1.0  # --shutdown-timeout of the PP=1 server


# -- a server process -----------------------------------------------------------------------


class ServerProcess:
    """``python -m pipepool serve`` on a free loopback port, logging to a file."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "pipepool", "serve", "--port", str(self.port), *args]
        with open(log_path, "wb") as log:  # a file, not a pipe: a full pipe would block it
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 90.0) -> ServerProcess:
        """Poll /health until ``ok`` (every model serves: a server of several answers 200 as
        soon as one does); ``health_seen`` keeps each distinct answer on the way."""
        self.health_seen: list[tuple[int, dict]] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(self.url + "/health", timeout=1)
            except httpx.TransportError:
                time.sleep(0.1)
                continue
            if (r.status_code, r.json()) not in self.health_seen:
                self.health_seen.append((r.status_code, r.json()))
            if r.status_code == 200 and r.json()["status"] == "ok":
                return self
            time.sleep(0.1)
        pytest.fail(f"server not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """``name{labels}`` -> value, from /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                samples[key] = float(value)
        return samples

    def children(self) -> list[tuple[int, str]]:
        """(pid, start time) of each child process: a pid alone could be reused later."""
        return [p for p in _processes() if _parent(p) == self.proc.pid]

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...


def _processes() -> list[tuple[int, str]]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            found.append((int(entry.name), stat[19]))  # field 22 of stat: start time
    return found


def _parent(process: tuple[int, str]) -> int | None:
    stat = _stat(process[0])
    return int(stat[1]) if stat else None


def _alive(process: tuple[int, str]) -> bool:
    stat = _stat(process[0])
    return stat is not None and stat[19] == process[1] and stat[0] != "Z"


def wait_for(condition, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


def assert_kv_blocks_all_free(server: ServerProcess) -> None:
    def settled():
        m = server.metrics()
        idle = m["pipepool_server_pending_inputs"] == 0 and m["pipepool_running_requests"] == 0
        return idle and m["pipepool_kv_blocks_free"] == m["pipepool_kv_blocks_total"]

    wait_for(settled, what="every KV block free")


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(qwen3_path, tmp_path_factory):
    """A PP=1 and a PP=2 server on the tiny Qwen3, started side by side. The PP=1 server waits
    only a second for requests in flight when told to stop (the last test needs that)."""
    logs = tmp_path_factory.mktemp("server-logs")
    common = [
        "--model",
        str(qwen3_path),
        "--served-model-name",
        MODEL,
        "--max-num-batched-tokens",
        str(BUDGET),
        "--no-access-log",
        "--allow-token-ids",
    ]
    started = {
        1: ServerProcess([*common, "--shutdown-timeout", str(SHUTDOWN_S)], logs / "pp1.log"),
        2: ServerProcess([*common, "--pp", "2"], logs / "pp2.log"),
    }
    try:
        yield {pp: s.wait_ready() for pp, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="module")
def server(servers) -> ServerProcess:
    return servers[1]


@pytest.fixture(scope="module")
def engine(qwen3_path):
    """The in-process reference: same model, same options as the servers."""
    with pipepool.Engine(str(qwen3_path), max_num_batched_tokens=BUDGET) as e:
        yield e


@pytest.fixture(scope="module")
def tokenizer(qwen3_path) -> Tokenizer:
    return Tokenizer.from_file(str(qwen3_path / "tokenizer.json"))


def n_tokens(tokenizer: Tokenizer, texts: list[str]) -> int:
    return sum(len(e.ids) for e in tokenizer.encode_batch(texts))


def client(server: ServerProcess, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, **kwargs)


def decode(embedding) -> np.ndarray:
    return np.frombuffer(base64.b64decode(embedding), dtype="<f4")


def assert_close(got, expected) -> None:
    got, expected = np.asarray(got, dtype=np.float32), np.asarray(expected)
    assert got.shape == expected.shape
    assert cosine(got, expected).min() >= MIN_COSINE


# -- /v1/embeddings -------------------------------------------------------------------------


@pytest.mark.parametrize("pp", [1, 2])
def test_openai_client_default_base64_matches_engine(servers, pp, engine, tokenizer):
    sent = []
    http = httpx.Client(event_hooks={"request": [lambda r: sent.append(json.loads(r.read()))]})
    prompts = long_prompts()
    result = client(servers[pp], http_client=http).embeddings.create(model=MODEL, input=prompts)
    assert sent[0]["encoding_format"] == "base64"  # what the official client asks for
    assert result.model == MODEL and result.object == "list"
    assert [d.index for d in result.data] == list(range(len(prompts)))
    expected = engine.embed(prompts)
    for d, e in zip(result.data, expected, strict=True):
        assert_close(d.embedding, e)
    assert result.usage.prompt_tokens == n_tokens(tokenizer, prompts)
    assert result.usage.total_tokens == result.usage.prompt_tokens


def test_openai_client_float_with_dimensions(server, engine, tokenizer):
    prompts = SENTENCES[:5]
    result = client(server).embeddings.create(
        model=MODEL, input=prompts, encoding_format="float", dimensions=16
    )
    expected = engine.embed(prompts, dimensions=16)
    for d, e in zip(result.data, expected, strict=True):
        assert len(d.embedding) == 16
        assert_close(d.embedding, e)
    assert result.usage.prompt_tokens == n_tokens(tokenizer, prompts)


def test_a_large_float_answer_sent_in_parts_is_whole_and_right(server, engine):
    # 600 vectors of 64 floats: past lock_blocks.LOCK_VALUES, so built and sent in blocks.
    prompts = [f"{SENTENCES[i % len(SENTENCES)]} {i}" for i in range(600)]
    body = {"model": MODEL, "input": prompts, "encoding_format": "float"}
    r = httpx.post(server.url + "/v1/embeddings", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert int(r.headers["content-length"]) == len(r.content)
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(len(prompts)))
    assert_close([d["embedding"] for d in data], engine.embed(prompts))


def test_raw_http_every_input_form(server, engine, tokenizer):
    url = server.url + "/v1/embeddings"
    ids = [e.ids for e in tokenizer.encode_batch(SENTENCES[:3])]
    forms = {
        "a string": (SENTENCES[0], [SENTENCES[0]]),
        "strings": (SENTENCES[:3], SENTENCES[:3]),
        "token ids": (ids[0], [ids[0]]),
        "token-id lists": (ids, ids),
    }
    for name, (given, as_engine_input) in forms.items():
        for fmt in ("float", "base64"):
            r = httpx.post(url, json={"input": given, "model": MODEL, "encoding_format": fmt})
            assert r.status_code == 200, (name, r.text)
            body = r.json()
            assert set(body) == {"object", "data", "model", "usage"}
            assert body["usage"] == {
                "prompt_tokens": sum(len(x) for x in ids[: len(as_engine_input)]),
                "total_tokens": sum(len(x) for x in ids[: len(as_engine_input)]),
            }
            expected = engine.embed(as_engine_input)
            for i, (d, e) in enumerate(zip(body["data"], expected, strict=True)):
                assert set(d) == {"object", "index", "embedding"}
                assert d["object"] == "embedding" and d["index"] == i
                assert_close(decode(d["embedding"]) if fmt == "base64" else d["embedding"], e)


def test_an_empty_text_is_400_and_a_blank_one_is_a_text(server, engine):
    """docs/python-api.md, "Empty and blank inputs", over HTTP: "" is refused naming it, as
    OpenAI (and TEI, its own way) refuse it; a whitespace-only text is embedded."""
    r = httpx.post(server.url + "/v1/embeddings", json={"input": ["fine", ""]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    assert "input 1 is an empty string" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/embed", json={"inputs": ["fine", ""]})
    assert (r.status_code, r.json()["error_type"]) == (400, "Empty"), r.text
    r = httpx.post(server.url + "/v1/embeddings", json={"input": [" \t "]})
    assert r.status_code == 200, r.text
    assert_close(r.json()["data"][0]["embedding"], engine.embed([" \t "])[0])


def test_extensions_normalize_and_truncate(server, engine):
    text = long_prompts()[3]
    r = httpx.post(
        server.url + "/v1/embeddings",
        json={"input": [text], "normalize": False, "truncate_prompt_tokens": 50, "user": "u1"},
    )
    assert r.status_code == 200, r.text
    got = np.asarray(r.json()["data"][0]["embedding"])
    expected = engine.embed([text], normalize=False, truncate_prompt_tokens=50)[0]
    assert abs(np.linalg.norm(got) - np.linalg.norm(expected)) < 1e-3 * np.linalg.norm(expected)
    assert_close(got, expected)
    assert r.json()["usage"]["prompt_tokens"] == 50


# -- the other routes -----------------------------------------------------------------------


def test_pooling_token_embed_returns_token_embeddings(server, engine, tokenizer):
    prompts = [SENTENCES[0], long_prompts()[2]]
    expected = engine.embed_tokens(prompts)
    for fmt in ("float", "base64"):
        body = {"input": prompts, "encoding_format": fmt, "task": "token_embed"}
        r = httpx.post(server.url + "/pooling", json=body)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["model"] == MODEL
        assert body["usage"]["prompt_tokens"] == n_tokens(tokenizer, prompts)
        for i, (d, e) in enumerate(zip(body["data"], expected, strict=True)):
            assert d["object"] == "pooling" and d["index"] == i
            got = decode(d["data"]).reshape(e.shape) if fmt == "base64" else np.array(d["data"])
            assert got.shape == e.shape  # [num_tokens, hidden]
            assert_close(got, e)  # row by row


def test_tokenize_matches_tokenizer(server, tokenizer):
    text = SENTENCES[1]
    for field in ("prompt", "input"):
        r = httpx.post(server.url + "/tokenize", json={field: text, "model": MODEL})
        assert r.status_code == 200, r.text
        ids = tokenizer.encode(text).ids
        assert r.json() == {"tokens": ids, "count": len(ids), "max_model_len": 4096}


def test_models_health_docs(server):
    models = client(server).models.list()
    ids = [m.id for m in models.data]
    assert ids[0] == MODEL and "qwen3" in ids  # --served-model-name first, the folder name too
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    docs = httpx.get(server.url + "/docs").text
    assert "/v1/embeddings" in docs and "<script" not in docs and "cdn" not in docs.lower()
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    assert {"/v1/embeddings", "/pooling", "/tokenize", "/v1/models", "/embed", "/info"} <= set(
        paths
    )


def test_metrics_expose_engine_and_http_counters(server):
    httpx.post(server.url + "/v1/embeddings", json={"input": "count me"})
    r = httpx.get(server.url + "/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    m = server.metrics()
    for name in (
        "pipepool_engine_ready",
        "pipepool_requests_submitted_total",
        "pipepool_requests_finished_total",
        "pipepool_prompt_tokens_finished_total",
        "pipepool_queue_waiting_requests",
        "pipepool_running_requests",
        "pipepool_step_time_seconds_count",
        'pipepool_stage_busy_seconds_total{stage="0"}',
        "pipepool_kv_blocks_free",
        "pipepool_kv_blocks_total",
        "pipepool_server_pending_inputs",
        "pipepool_server_waiting_inputs",
        'pipepool_http_requests_total{route="/v1/embeddings",status="200"}',
        'python_gc_collections_total{generation="0"}',
        'python_gc_collections_total{generation="2"}',
        'python_gc_objects_collected_total{generation="1"}',
    ):
        assert name in m, name
    assert m["pipepool_engine_ready"] == 1
    assert m["pipepool_requests_finished_total"] >= 1
    assert m['pipepool_step_time_seconds_bucket{le="+Inf"}'] >= 1
    assert m['python_gc_collections_total{generation="0"}'] >= 1


def test_metrics_write_each_series_once_by_the_prometheus_rules(server):
    """Requests on one route answered by the model (200) and before any model was chosen (a
    body that fails to parse: 400, a name no model has: 404) share their series in a server
    of one model: each is written once, as the sum of both."""
    before = assert_valid_and_unique(httpx.get(server.url + "/metrics").text)
    route = server.url + "/v1/embeddings"
    assert httpx.post(route, json={"input": "count me"}).status_code == 200
    assert httpx.post(route, content=b"{not json").status_code == 400
    assert httpx.post(route, json={"input": "x", "model": "nope"}).status_code == 404
    after = assert_valid_and_unique(httpx.get(server.url + "/metrics").text)

    def count(name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        return after.get(key, 0) - before.get(key, 0)

    assert count("pipepool_http_requests_total", route="/v1/embeddings", status="200") == 1
    assert count("pipepool_http_requests_total", route="/v1/embeddings", status="400") == 1
    assert count("pipepool_http_requests_total", route="/v1/embeddings", status="404") == 1
    assert count("pipepool_http_request_duration_seconds_count", route="/v1/embeddings") == 3


def _server_timing(response: httpx.Response) -> dict[str, float]:
    entries = (entry.split(";dur=") for entry in response.headers["server-timing"].split(", "))
    return {name: float(ms) for name, ms in entries}


def test_server_timing_tells_where_a_request_spent_its_time(server):
    """A request with over INLINE_SIZE characters to tokenise (and numbers to serialise) goes
    to a lane's thread for both; a smaller one is tokenised and answered on the event loop."""
    started = time.perf_counter()
    inputs = ["time me " * 150, *["and me"] * 16]  # 1,296 characters; 17 x 64 numbers back
    r = httpx.post(server.url + "/v1/embeddings", json={"input": inputs})
    client_ms = (time.perf_counter() - started) * 1000
    assert r.status_code == 200
    spent = _server_timing(r)
    assert set(spent) == {"app", "lane", "tokenize", "engine", "offload"}
    assert spent["app"] > 0 and spent["tokenize"] > 0 and spent["engine"] > 0, spent
    assert 0 <= spent["lane"] <= spent["tokenize"]
    assert spent["tokenize"] + spent["engine"] + spent["offload"] <= spent["app"] <= client_ms
    small = httpx.post(server.url + "/v1/embeddings", json={"input": ["time me " * 50, "and me"]})
    assert small.status_code == 200
    spent = _server_timing(small)
    assert set(spent) == {"app", "tokenize", "engine"}, spent
    assert spent["tokenize"] + spent["engine"] <= spent["app"]
    # An answer without the engine says only how long the app took.
    assert set(_server_timing(httpx.get(server.url + "/health"))) == {"app"}
    assert set(_server_timing(httpx.post(server.url + "/v1/embeddings", json={}))) == {"app"}


# -- many clients ---------------------------------------------------------------------------


def _mixed_requests(count: int) -> list[list[str]]:
    """Short and long prompts, one to three per request, different for every request."""
    pool = long_prompts() + SENTENCES
    requests = []
    for i in range(count):
        n = 1 + i % 3
        requests.append([f"{i}: {pool[(i * 7 + k) % len(pool)]}" for k in range(n)])
    return requests


@pytest.mark.parametrize("pp", [1, 2])
def test_64_concurrent_clients_get_their_own_results(servers, pp, engine, tokenizer):
    server = servers[pp]
    requests = _mixed_requests(64)
    before = server.metrics()
    results: list = [None] * len(requests)
    barrier = threading.Barrier(len(requests))

    def call(i: int) -> None:
        with httpx.Client(timeout=120) as http:
            barrier.wait()  # all at once: their inputs share steps
            results[i] = http.post(server.url + "/v1/embeddings", json={"input": requests[i]})

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    flat = [p for r in requests for p in r]
    expected = iter(engine.embed(flat))
    for prompts, r in zip(requests, results, strict=True):
        assert r.status_code == 200, r.text
        body = r.json()
        assert [d["index"] for d in body["data"]] == list(range(len(prompts)))
        for d in body["data"]:
            assert_close(d["embedding"], next(expected))
        assert body["usage"]["prompt_tokens"] == n_tokens(tokenizer, prompts)
    after = server.metrics()
    assert after["pipepool_chunked_requests_total"] > before["pipepool_chunked_requests_total"]
    assert_kv_blocks_all_free(server)


AFTER_ABORT = ("pipepool_server_aborted_inputs_total", "pipepool_requests_aborted_total")


@pytest.mark.parametrize("pp", [1, 2])
def test_client_disconnect_aborts_its_requests(servers, pp, engine):
    server = servers[pp]
    before = server.metrics()
    many_long = [f"{i} {long_prompts()[3]}" for i in range(48)]  # ~30k tokens: seconds of work

    with pytest.raises(httpx.ReadTimeout):
        # The read timeout closes the connection while the server is still computing.
        httpx.post(
            server.url + "/v1/embeddings",
            json={"input": many_long},
            timeout=httpx.Timeout(30, read=0.5),
        )

    def aborted():
        # The server asks for the abort; the engine applies it at its next step.
        m = server.metrics()
        return all(m[k] > before[k] for k in AFTER_ABORT) and m

    m = wait_for(aborted, what="the abort")
    finished = m["pipepool_requests_finished_total"] - before["pipepool_requests_finished_total"]
    assert finished < len(many_long)  # the rest never ran
    assert_kv_blocks_all_free(server)
    # ...and the server goes on serving.
    r = httpx.post(server.url + "/v1/embeddings", json={"input": [SENTENCES[0]]})
    assert_close(r.json()["data"][0]["embedding"], engine.embed([SENTENCES[0]])[0])


def test_one_word_is_answered_promptly_while_10mb_bodies_are_handled(server, engine):
    """Texts are checked against a character bound before they are tokenised, and large
    requests tokenise in a lane of their own: two 10 MB bodies (refused), and one of five
    2 MB texts (each cut to the bound, tokenised and truncated), do not hold up a one-word
    request. The truncated texts take 5 x 4096 / BUDGET steps, and a small call waits for at
    most one chunked prompt's steps (the scheduler's turns), so the word is answered first
    however the machine's load delays its arrival."""
    huge = "word " * 2_000_000
    refuse = {"input": huge, "long_inputs": "error"}
    truncated = {"input": ["word " * 400_000] * 5}  # truncated: the default
    big = [refuse, refuse, truncated]
    answers: dict = {}

    order = []  # which answers arrived, in order

    def send(i: int) -> None:
        with httpx.Client(timeout=120) as http:
            answers[i] = http.post(server.url + "/v1/embeddings", json=big[i])
        order.append(i)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(big))]
    for t in threads:
        t.start()
    wait_for(lambda: server.metrics()["pipepool_http_requests_in_flight"] >= 2, what="uploads")
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "word"}, timeout=60)
    order.append("word")
    for t in threads:
        t.join()
    assert r.status_code == 200
    assert_close(r.json()["data"][0]["embedding"], engine.embed(["word"])[0])
    # The one word is not queued behind the truncated 10 MB body's tokenising and its steps.
    assert order.index("word") < order.index(2), order
    for i in (0, 1):
        assert answers[i].status_code == 400, answers[i].text
        err = answers[i].json()["error"]
        assert err["code"] == "context_length_exceeded" and "characters" in err["message"]
    assert answers[2].status_code == 200, answers[2].text
    assert answers[2].json()["usage"]["prompt_tokens"] == 5 * 4096


def test_engine_and_cli_import_without_the_server_extras():
    code = (
        "import sys\n"
        "for name in ('fastapi', 'uvicorn', 'starlette', 'pydantic'):\n"
        "    sys.modules[name] = None  # importing it now raises ImportError\n"
        "import pipepool, pipepool.commands.cli\n"
        "parser = pipepool.commands.cli.build_parser()\n"
        "args = parser.parse_args(['serve', '--port', '9', '--pp', '2'])\n"
        "assert (args.port, args.pipeline_parallel_size, args.host) == (9, 2, '127.0.0.1'), args\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPEPOOL_")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr


def test_server_flags_read_pipepool_environment_variables(monkeypatch):
    from pipepool.commands.cli import build_parser

    monkeypatch.setenv("PIPEPOOL_API_KEY", "k")
    monkeypatch.setenv("PIPEPOOL_MAX_INPUTS_PER_REQUEST", "7")
    monkeypatch.setenv("PIPEPOOL_PORT", "81")
    args = build_parser().parse_args(["serve", "--port", "82"])
    assert (args.api_key, args.max_inputs_per_request) == ("k", 7)
    assert args.port == 82  # the command line wins


# -- a stage dies, and the pipeline heals --------------------------------------------------


def test_killed_stage_heals_under_load_and_no_client_sees_it(servers, engine):
    server = servers[2]
    before = server.metrics()
    requests = _mixed_requests(24)
    results: list = [None] * len(requests)

    def call(i: int) -> None:
        with httpx.Client(timeout=180) as http:
            results[i] = http.post(server.url + "/v1/embeddings", json={"input": requests[i]})

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    wait_for(
        lambda: (
            server.metrics()["pipepool_requests_finished_total"]
            > before["pipepool_requests_finished_total"]
        ),
        what="the first results",
    )
    (stage,) = server.children()
    os.kill(stage[0], signal.SIGKILL)
    for t in threads:
        t.join()
    expected = iter(engine.embed([p for r in requests for p in r]))
    for prompts, r in zip(requests, results, strict=True):
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == len(prompts)
        for d in r.json()["data"]:
            assert_close(d["embedding"], next(expected))
    m = server.metrics()
    assert m["pipepool_pipeline_restarts_total"] == before["pipepool_pipeline_restarts_total"] + 1
    assert m["pipepool_requests_retried_total"] > before["pipepool_requests_retried_total"]
    assert m['pipepool_engine_errors_total{kind="StageFailure"}'] == 1
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert "restarting its stages" in server.log()
    assert_kv_blocks_all_free(server)
    (new_stage,) = server.children()
    assert new_stage != stage and not _alive(stage)


def test_a_stopped_stage_is_seen_within_15_s_and_its_requests_are_answered(servers, engine):
    """SIGSTOP of the PP=2 server's stage process at default settings (the watchdog's learnt
    bound: 10 s on a pipeline this fast): /health turns 503 ``degraded`` within 15 s of the
    stop, the stages are restarted, and the requests in flight are answered after the heal,
    every vector right."""
    server = servers[2]
    bodies = _mixed_requests(12)
    want = {i: engine.embed(b) for i, b in enumerate(bodies)}
    before = server.metrics()
    # Past the watchdog's warm-up: the pipeline (maybe restarted above) returns results.
    warm = httpx.post(server.url + "/v1/embeddings", json={"input": long_prompts()}, timeout=60)
    assert warm.status_code == 200
    assert server.metrics()["pipepool_steps_total"] - before["pipepool_steps_total"] > 16
    stop_load = threading.Event()
    answers: list[tuple[int, float, float, httpx.Response]] = []  # (body, sent, answered, r)

    def load(k: int) -> None:
        with httpx.Client(timeout=120) as http:
            i = k
            while not stop_load.is_set():
                sent = time.monotonic()
                r = http.post(server.url + "/v1/embeddings", json={"input": bodies[i]})
                answers.append((i, sent, time.monotonic(), r))
                i = (i + 1) % len(bodies)

    threads = [threading.Thread(target=load, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    (stage,) = server.children()
    try:
        wait_for(lambda: len(answers) >= 6, what="the load's first answers")
        os.kill(stage[0], signal.SIGSTOP)
        stopped = time.monotonic()
        wait_for(lambda: httpx.get(server.url + "/health", timeout=5).status_code == 503,
                 timeout=60, what="/health not ok")  # fmt: skip
        seen_after = time.monotonic() - stopped
        assert httpx.get(server.url + "/health").json()["status"] in ("degraded", "ok")
        wait_for(lambda: httpx.get(server.url + "/health", timeout=5).status_code == 200,
                 timeout=60, what="the healed pipeline")  # fmt: skip
        healed = time.monotonic()
        wait_for(lambda: any(a[1] > healed for a in answers), what="answers after the heal")
    finally:
        stop_load.set()
        for t in threads:
            t.join()
        if _alive(stage):
            os.kill(stage[0], signal.SIGCONT)
    assert seen_after < 15.0, f"/health stayed ok {seen_after:.1f} s after the stop"
    spanning = [a for a in answers if a[1] < stopped and a[2] > healed]
    assert spanning, "no request was in flight across the stop and the heal"
    for i, _, _, r in answers:
        assert r.status_code == 200, r.text
        for d, e in zip(r.json()["data"], want[i], strict=True):
            assert_close(d["embedding"], e)
    m = server.metrics()
    assert m["pipepool_pipeline_restarts_total"] == before["pipepool_pipeline_restarts_total"] + 1
    assert "the stage processes are hung" in server.log()
    assert not _alive(stage)


# -- shutdown (last: it stops both servers) -------------------------------------------------


def test_sigterm_finishes_in_flight_request_then_exits_cleanly(servers, engine):
    server = servers[2]
    children = server.children()
    assert children, "a PP=2 server runs its second stage in a child process"
    prompts = [f"{i} {p}" for i in range(6) for p in long_prompts()]
    result = {}

    def in_flight() -> None:
        result["r"] = httpx.post(server.url + "/v1/embeddings", json={"input": prompts}, timeout=60)
        result["answered"] = time.monotonic()

    t = threading.Thread(target=in_flight)
    t.start()
    wait_for(lambda: server.metrics()["pipepool_server_pending_inputs"] > 0, what="the request")
    server.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    t.join()
    r = result["r"]
    assert r.status_code == 200, r.text
    assert result["answered"] > signalled, "the request was not in flight at SIGTERM"
    for d, e in zip(r.json()["data"], engine.embed(prompts), strict=True):
        assert_close(d["embedding"], e)
    assert server.proc.wait(timeout=60) == 0, server.log()
    assert not [c for c in children if _alive(c)], "stage processes left behind"
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health", timeout=2)


def test_requests_past_the_shutdown_timeout_get_503_and_no_traceback(servers):
    """Past --shutdown-timeout the requests still running are answered 503 with an OpenAI
    error body by their own routes (uvicorn would cancel them into a plain-text 500 and a
    traceback each)."""
    server = servers[1]
    many_long = [f"{i} {long_prompts()[3]}" for i in range(96)]  # ~60k tokens: many seconds
    result = {}

    def in_flight() -> None:
        result["r"] = httpx.post(
            server.url + "/v1/embeddings", json={"input": many_long}, timeout=120
        )

    finished_before = server.metrics()["pipepool_requests_finished_total"]  # earlier tests'
    t = threading.Thread(target=in_flight)
    t.start()

    def working() -> bool:  # this request is in, and the engine is computing it
        m = server.metrics()
        busy = m["pipepool_http_requests_in_flight"] >= 1
        return busy and m["pipepool_requests_finished_total"] > finished_before

    wait_for(working, what="work")
    server.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    t.join()
    r = result["r"]
    assert r.status_code == 503, r.text
    body = r.json()
    assert body["error"]["type"] == "server_error" and body["error"]["code"] == "shutting_down"
    assert SHUTDOWN_S <= time.monotonic() - signalled < SHUTDOWN_S + 10
    assert server.proc.wait(timeout=60) == 0, server.log()
    assert "Traceback" not in server.log()
