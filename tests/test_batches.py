"""OpenAI's Files and Batches APIs on a real ``pipepool serve`` of the bundled MiniLM, driven by
the official openai client: a batch's lines are answered as ``/v1/embeddings`` answers them,
bad lines land in the error file and the rest completes, a file that is not a batch for the
endpoint fails whole, cancel keeps the partial output, a server killed with SIGKILL mid-batch
finishes it when started again (every custom_id exactly once), and the limits and unknown ids
are answered 4xx with OpenAI error bodies. The runner's resume and expiry, and the background
priority reaching the tokenising thread, are tested in-process on a toy app."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import sqlite3
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
from fastapi import FastAPI, Request
from test_server import ServerProcess
from tiny_models import MIN_COSINE, SENTENCES, cosine

from pipepool.core.priority import background_work, is_background
from pipepool.jobs.batch_lines import LineChecker, answer_line
from pipepool.server.batch_runner import BatchRunner, Dispatcher
from pipepool.server.batch_store import BatchStore
from pipepool.server.front import AsyncEngine

# Slow: real `pipepool serve` processes running Batch API jobs.
pytestmark = pytest.mark.slow

BATCH_LINES = 300  # good requests in the main batch (benchmarks/batch_latency.py runs 5,000)
BIG_LINES = 600  # a batch long enough to be caught half-way (cancel, kill)
KEY = "batch-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "all-MiniLM-L6-v2"
MAX_FILE_BYTES = 1_000_000
MAX_BODY_BYTES = 64 << 10  # below MAX_FILE_BYTES: uploads are held to the batch file limit
MAX_REQUESTS = 1500
# The server's queue, half of which a batch keeps in flight: small, so that a batch of
# BIG_LINES is caught with lines still to send.
MAX_QUEUED = 256
FINAL = ("completed", "failed", "expired", "cancelled")


# -- helpers ----------------------------------------------------------------------------------


def text(i: int) -> str:
    return f"{SENTENCES[i % len(SENTENCES)]} (line {i})"


def line(custom_id: str, body: dict | None, url: str = "/v1/embeddings") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(lines: list) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


def embedding_lines(count: int, prefix: str = "req") -> list[dict]:
    """Requests of one text each; every tenth holds two texts."""
    lines = []
    for i in range(count):
        inputs = [text(i), text(i + 7)] if i % 10 == 0 else text(i)
        lines.append(line(f"{prefix}-{i}", {"model": MODEL, "input": inputs}))
    return lines


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def submit(client: openai.OpenAI, lines: list, endpoint: str = "/v1/embeddings"):
    source = client.files.create(file=("batch.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(
        input_file_id=source.id,
        endpoint=endpoint,  # type: ignore[arg-type]  # the client lists OpenAI's routes only
        completion_window="24h",
        metadata={"test": "yes"},
    )


def wait_batch(client: openai.OpenAI, batch_id: str, until=None, timeout: float = 180.0):
    """Poll the batch until ``until(batch)`` (default: a final status)."""
    until = until or (lambda b: b.status in FINAL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        time.sleep(0.02)
    pytest.fail(f"batch {batch_id} never got there: {batch}")


def file_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def online(server: ServerProcess, bodies: list[dict], path: str = "/v1/embeddings") -> list:
    """What the server answers each body online."""
    with (
        httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http,
        ThreadPoolExecutor(8) as pool,
    ):
        return list(pool.map(lambda b: http.post(path, json=b).json(), bodies))


def assert_same_vectors(got: dict, expected: dict) -> None:
    a = np.array([d["embedding"] for d in got["data"]], dtype=np.float32)
    b = np.array([d["embedding"] for d in expected["data"]], dtype=np.float32)
    assert a.shape == b.shape
    assert cosine(a, b).min() >= MIN_COSINE


def serve(state_dir: Path, log: Path, *extra: str) -> ServerProcess:
    args = ["--state-dir", str(state_dir), "--api-key", KEY, "--no-access-log"]
    args += ["--max-batch-file-bytes", str(MAX_FILE_BYTES), "--max-body-bytes", str(MAX_BODY_BYTES)]
    args += ["--max-batch-requests", str(MAX_REQUESTS), "--max-queued-requests", str(MAX_QUEUED)]
    args += ["--max-inputs-per-request", "64", *extra]
    return ServerProcess(args, log)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("batches")
    s = serve(root / "state", root / "server.log")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return client_of(server)


# -- a batch, end to end ----------------------------------------------------------------------


def test_embeddings_batch_answers_as_online_and_bad_lines_go_to_the_error_file(server, client):
    good = embedding_lines(BATCH_LINES)
    bad = [
        b"this line is not JSON",
        line("req-0", {"model": MODEL, "input": "a repeated custom_id"}),
        line("bad-url", {"input": "x"}, url="/v1/chat/completions"),
        line("bad-body", {"model": MODEL, "input": 5}),
        line("bad-model", {"model": "text-embedding-3-small", "input": "x"}),
        line("no-body", None),
    ]
    lines = [*good[:100], *bad[:3], b"", *good[100:200], *bad[3:], *good[200:]]
    created = submit(client, lines)
    assert created.status == "validating" and created.request_counts.total == 0
    assert created.expires_at == created.created_at + 24 * 3600
    batch = wait_batch(client, created.id)

    assert batch.status == "completed", batch
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (len(good) + len(bad), len(good), 6)
    assert created.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
    assert batch.failed_at is None and batch.cancelled_at is None and batch.errors is None
    assert batch.metadata == {"test": "yes"}

    outputs = file_lines(client, batch.output_file_id)
    assert sorted(o["custom_id"] for o in outputs) == sorted(g["custom_id"] for g in good)
    assert len({o["id"] for o in outputs}) == len({o["response"]["request_id"] for o in outputs})
    assert all(o["error"] is None and o["response"]["status_code"] == 200 for o in outputs)
    by_id = {o["custom_id"]: o["response"]["body"] for o in outputs}
    for g, expected in zip(good, online(server, [g["body"] for g in good]), strict=True):
        assert_same_vectors(by_id[g["custom_id"]], expected)
    # usage: the prompt tokens of the answered lines (the failed ones read none)
    read = sum(body["usage"]["prompt_tokens"] for body in by_id.values())
    assert read > 0 and batch.usage is not None
    assert (batch.usage.input_tokens, batch.usage.total_tokens) == (read, read)
    assert batch.usage.output_tokens == 0

    errors = {(e["custom_id"], _code(e)): e for e in file_lines(client, batch.error_file_id)}
    assert set(errors) == {
        (None, "invalid_json_line"),
        ("req-0", "duplicate_custom_id"),
        ("bad-url", "invalid_url"),
        ("bad-body", "invalid_value"),
        ("bad-model", "model_not_found"),
        ("no-body", "missing_required_parameter"),
    }
    assert errors["bad-body", "invalid_value"]["response"]["status_code"] == 400
    assert errors["bad-model", "model_not_found"]["response"]["status_code"] == 404
    assert errors["no-body", "missing_required_parameter"]["response"] is None
    assert "line 101 " in errors[None, "invalid_json_line"]["error"]["message"]
    for kind in (batch.output_file_id, batch.error_file_id):
        assert client.files.retrieve(kind).purpose == "batch_output"
    with pytest.raises(openai.ConflictError):  # it has ended
        client.batches.cancel(batch.id)


def _code(output: dict) -> str:
    """An error line's code: its ``error``'s, or its answer's error body's."""
    if output["error"] is not None:
        return output["error"]["code"]
    return output["response"]["body"]["error"]["code"]


@pytest.mark.parametrize(
    ("lines", "code"),
    [
        ([line("a", {"input": "x"}), line("b", {"query": "q", "documents": ["d"]}, "/v1/rerank")],
         "mismatched_url"),
        ([line(f"n{i}", {"input": "x"}) for i in range(MAX_REQUESTS + 1)], "too_many_requests"),
        ([b"id,text", b"1,hello"], "invalid_file"),
    ],
    ids=["mixed-endpoints", "too-many-requests", "not-a-batch-file"],
)  # fmt: skip
def test_a_file_that_is_not_a_batch_for_the_endpoint_fails_whole(client, lines, code):
    batch = wait_batch(client, submit(client, lines).id)
    assert batch.status == "failed" and batch.failed_at is not None
    assert batch.errors is not None and batch.errors.data[0].code == code, batch.errors
    if code == "mismatched_url":
        assert batch.errors.data[0].line == 2 and "/v1/rerank" in batch.errors.data[0].message
    assert batch.output_file_id is None and batch.error_file_id is None


def test_cancel_stops_the_batch_and_keeps_its_partial_output(client):
    created = submit(client, embedding_lines(BIG_LINES))
    wait_batch(client, created.id, until=lambda b: b.request_counts.completed > 0)
    cancelling = client.batches.cancel(created.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    batch = wait_batch(client, created.id)
    assert batch.status == "cancelled" and batch.cancelled_at >= batch.cancelling_at
    counts = batch.request_counts
    assert 0 < counts.completed < counts.total == BIG_LINES
    outputs = file_lines(client, batch.output_file_id)
    assert len(outputs) == counts.completed == len({o["custom_id"] for o in outputs})
    assert client.batches.cancel(batch.id).status == "cancelled"  # once cancelled, it stays


def test_list_pages_newest_first(client):
    ids = [submit(client, embedding_lines(1, prefix=f"page{i}")).id for i in range(3)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    assert (first.first_id, first.last_id) == (ids[2], ids[1])
    rest = client.batches.list(limit=100, after=ids[1])
    assert rest.data[0].id == ids[0]
    every = [b.id for b in client.batches.list(limit=2)]  # the client follows has_more, after
    assert every[:3] == ids[::-1] and len(every) == len(set(every))
    for batch_id in ids:
        wait_batch(client, batch_id)


# -- limits and errors ------------------------------------------------------------------------


def test_uploads_are_held_to_the_batch_file_limit_not_the_body_limit(server, client):
    lines = embedding_lines(2000)
    body = jsonl(lines)
    assert MAX_BODY_BYTES < len(body) < MAX_FILE_BYTES
    stored = client.files.create(file=("big.jsonl", body), purpose="batch")
    assert (stored.bytes, stored.filename, stored.purpose) == (len(body), "big.jsonl", "batch")
    assert client.files.content(stored.id).content == body
    too_big = b"x" * (MAX_FILE_BYTES + 1)
    with pytest.raises(openai.APIStatusError) as caught:
        client.files.create(file=("huge.jsonl", too_big), purpose="batch")
    assert caught.value.status_code == 413
    assert caught.value.body["code"] == "file_too_large"  # type: ignore[index]
    huge_body = {"input": "x" * MAX_BODY_BYTES}
    r = httpx.post(server.url + "/v1/embeddings", headers=AUTH, json=huge_body)
    assert r.status_code == 413  # every other route keeps --max-body-bytes


def test_bad_requests_are_4xx_with_openai_error_bodies(server, client):
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("a.jsonl", b"{}\n"), purpose="fine-tune")
    source = client.files.create(file=("a.jsonl", jsonl(embedding_lines(1))), purpose="batch")
    for changes in ({"endpoint": "/v1/chat/completions"}, {"completion_window": "1h"},
                    {"metadata": {f"k{i}": "v" for i in range(17)}}):  # fmt: skip
        fields = {"input_file_id": source.id, "endpoint": "/v1/embeddings",
                  "completion_window": "24h", **changes}  # fmt: skip
        r = httpx.post(server.url + "/v1/batches", headers=AUTH, json=fields)
        assert r.status_code == 400, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    unauthenticated = httpx.get(server.url + f"/v1/files/{source.id}")
    assert unauthenticated.status_code == 401


def test_unknown_ids_are_404(client):
    calls = [
        lambda: client.files.retrieve("file-nope"),
        lambda: client.files.content("file-nope"),
        lambda: client.files.delete("file-nope"),
        # an id of no file's form never reaches a path (schemathesis found a 500 here)
        lambda: client.files.delete("\x02g>\x1f©¯nÄ\x7fN"),
        lambda: client.batches.retrieve("batch_nope"),
        lambda: client.batches.cancel("batch_nope"),
        lambda: client.batches.create(
            input_file_id="file-nope", endpoint="/v1/embeddings", completion_window="24h"
        ),
    ]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.body["type"] == "invalid_request_error"  # type: ignore[index]


def test_delete_removes_a_file(client):
    source = client.files.create(file=("a.jsonl", b"{}\n"), purpose="batch")
    assert client.files.delete(source.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(source.id)


def test_files_are_listed_a_page_at_a_time_with_the_official_client(client):
    made = [
        client.files.create(file=(f"list-{i}.jsonl", b"{}\n"), purpose="batch") for i in range(3)
    ]
    ids = [f.id for f in made]
    newest = client.files.list(limit=2, purpose="batch")  # one page: the SDK's own object
    assert [f.id for f in newest.data] == ids[::-1][:2] and newest.has_more
    after = client.files.list(limit=2, after=newest.data[-1].id, purpose="batch")
    assert after.data[0].id == ids[0]
    oldest_first = [f.id for f in client.files.list(order="asc", purpose="batch")]
    assert oldest_first.index(ids[0]) < oldest_first.index(ids[1]) < oldest_first.index(ids[2])
    every = {f.id for f in client.files.list()}  # auto-paging, batches' files too
    assert set(ids) <= every
    assert not [f for f in client.files.list(purpose="batch_output") if f.id in ids]
    client.files.delete(ids[1])
    assert ids[1] not in {f.id for f in client.files.list()}


def test_openapi_documents_the_batch_objects(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    for path in ("/v1/files", "/v1/files/{file_id}/content", "/v1/batches/{batch_id}/cancel"):
        assert path in schema["paths"]
    assert {"Batch", "FileObject", "BatchList", "FileList"} <= set(schema["components"]["schemas"])


# -- a server killed mid-batch ----------------------------------------------------------------


def test_a_server_killed_mid_batch_finishes_it_when_started_again(tmp_path):
    """The batch's input is pinned while it runs (so a kill never loses its answered lines),
    and a clean stop leaves the database file alone a complete copy of the records."""
    lines = embedding_lines(BIG_LINES)
    state = tmp_path / "state"
    first = serve(state, tmp_path / "first.log").wait_ready()
    try:
        client = client_of(first)
        created = submit(client, lines)
        running = wait_batch(
            client, created.id, until=lambda b: b.request_counts.completed > 0 or b.status in FINAL
        )
        with pytest.raises(openai.ConflictError) as pinned:
            client.files.delete(created.input_file_id)
        assert pinned.value.body["code"] == "file_in_use"  # type: ignore[index]
        assert created.id in pinned.value.body["message"]  # type: ignore[index]
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
    finally:
        first.stop()
    done_before = running.request_counts.completed + running.request_counts.failed
    assert running.status == "in_progress" and 0 < done_before < BIG_LINES

    second = serve(tmp_path / "state", tmp_path / "second.log").wait_ready()
    try:
        client = client_of(second)
        batch = wait_batch(client, created.id)
        assert batch.status == "completed"
        assert (batch.request_counts.completed, batch.request_counts.failed) == (BIG_LINES, 0)
        outputs = file_lines(client, batch.output_file_id)
        seen = Counter(o["custom_id"] for o in outputs)
        assert seen == Counter(g["custom_id"] for g in lines)  # each exactly once
        resumed = [x for x in second.log().splitlines() if "resumes" in x]
        assert len(resumed) == 1 and int(resumed[0].split(": ")[-1].split()[0]) >= done_before
        sample = lines[:: BIG_LINES // 20]
        by_id = {o["custom_id"]: o["response"]["body"] for o in outputs}
        for g, expected in zip(sample, online(second, [g["body"] for g in sample]), strict=True):
            assert_same_vectors(by_id[g["custom_id"]], expected)
    finally:
        assert second.stop() == 0
    wal = state / "batches.sqlite3-wal"
    assert not wal.exists() or wal.stat().st_size == 0  # checkpointed at the stop
    alone = tmp_path / "alone.sqlite3"
    shutil.copyfile(state / "batches.sqlite3", alone)
    with sqlite3.connect(alone) as db:
        row = db.execute("SELECT status, completed FROM batches WHERE id = ?", (created.id,))
        assert row.fetchone() == ("completed", BIG_LINES)
    db.close()


# -- in-process: the runner on a toy app ------------------------------------------------------


class ToyApp:
    """A FastAPI app with a /v1/embeddings that answers each input's length, and records what
    it was asked and whether the call was background work."""

    def __init__(self, on_call=lambda n: None) -> None:
        self.calls: list[str] = []
        self.background: list[bool] = []
        self.app = FastAPI()

        @self.app.post("/v1/embeddings")
        async def embeddings(request: Request) -> dict:
            body = await request.json()
            self.calls.append(body["input"])
            self.background.append(is_background())
            on_call(len(self.calls))
            await asyncio.sleep(0.001)
            return {"data": [{"embedding": [float(len(body["input"]))]}]}


def _stored_batch(state_dir: Path, count: int) -> tuple[BatchStore, str]:
    store = BatchStore(state_dir)
    file_id, part = store.new_upload()
    part.write_bytes(jsonl([line(f"c{i}", {"input": "x" * i}) for i in range(count)]))
    store.add_file(file_id, part, filename="in.jsonl", purpose="batch")
    return store, store.create_batch(file_id, "/v1/embeddings", "24h", None).id


async def _run_until(runner: BatchRunner, done) -> None:
    task = asyncio.create_task(runner.run())
    while not done():
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _runner(state_dir: Path, toy: ToyApp, **options) -> BatchRunner:
    dispatcher = Dispatcher(toy.app, api_key=None, engine_failed=lambda: False)
    options = {"ready": lambda: True, "stopping": lambda: False, **options}
    return BatchRunner(state_dir, dispatcher, max_requests=100, window_inputs=4, poll_s=0.01,
                       **options)  # fmt: skip


def test_runner_resumes_exactly_once_past_uncommitted_bytes(tmp_path):
    store, batch_id = _stored_batch(tmp_path, 40)
    toy = ToyApp()
    asyncio.run(_runner(tmp_path, toy, stopping=lambda: len(toy.calls) >= 10).run())
    record = store.batch(batch_id)
    assert record is not None and record.status == "in_progress"
    assert 10 <= record.completed < 40
    with open(store.path(record.out_file), "ab") as body:  # written, never committed: a kill
        body.write(b'{"id":"batch_req_x","custom_id":"c39","response":{"status_co')
    asyncio.run(_run_until(_runner(tmp_path, toy), lambda: store.status(batch_id) == "completed"))
    record = store.batch(batch_id)
    assert record is not None and record.output_file_id is not None
    outputs = [json.loads(x) for x in store.path(record.output_file_id).read_bytes().splitlines()]
    assert sorted(o["custom_id"] for o in outputs) == sorted(f"c{i}" for i in range(40))
    assert len(toy.calls) == 40  # nothing answered twice: the stop let lines in flight finish
    assert all(toy.background)


def test_runner_expires_a_batch_keeping_what_it_answered(tmp_path):
    store, batch_id = _stored_batch(tmp_path, 30)
    record = store.batch(batch_id)
    assert record is not None
    now = [float(record.created_at)]

    def on_call(count: int) -> None:
        if count == 6:
            now[0] = record.expires_at + 1.0

    toy = ToyApp(on_call)
    runner = _runner(tmp_path, toy, clock=lambda: now[0])
    asyncio.run(_run_until(runner, lambda: store.status(batch_id) == "expired"))
    final = store.batch(batch_id)
    assert final is not None and final.expired_at is not None
    answered = [json.loads(x) for x in store.path(final.out_file).read_bytes().splitlines()]
    expired = [json.loads(x) for x in store.path(final.err_file).read_bytes().splitlines()]
    assert len(answered) == len(toy.calls) < 30
    assert {e["error"]["code"] for e in expired} == {"batch_expired"}
    ids = [o["custom_id"] for o in answered + expired]
    assert sorted(ids) == sorted(f"c{i}" for i in range(30))


def test_background_work_reaches_the_tokenising_thread():
    seen = []
    owner = SimpleNamespace(engine=object(), error=None)
    front = AsyncEngine(owner, max_queued=8, threads=1)  # type: ignore[arg-type]

    def check(_engine) -> None:  # what Engine.submit sees, on a tokenising thread
        seen.append(is_background())

    async def call(background: bool) -> None:
        if background:
            with background_work():
                await front.run_call(1, check)
        else:
            await front.run_call(1, check)

    asyncio.run(call(True))
    asyncio.run(call(False))
    front.close()
    assert seen == [True, False]


def test_output_lines_splice_the_answer_and_checker_refuses_bad_lines():
    out = json.loads(answer_line("c1", 200, b'{"data":[1.5]}', True))
    assert out["response"]["body"] == {"data": [1.5]} and out["error"] is None
    assert json.loads(answer_line("c1", 500, b"oops\n", False))["response"]["body"] == "oops\n"
    checker = LineChecker("/v1/embeddings")
    assert checker.check(1, json.dumps(line("a", {"input": "x"})).encode()).custom_id == "a"
    codes = [
        checker.check(2, json.dumps(line("a", {"input": "x"})).encode()),
        checker.check(3, b"[1, 2]"),
        checker.check(4, json.dumps({**line("b", {}), "method": "GET"}).encode()),
        checker.check(5, json.dumps(line("c", {}, url="/v1/score")).encode()),
    ]
    assert [getattr(c, "code", None) for c in codes] == [
        "duplicate_custom_id", "invalid_json_line", "invalid_method", "mismatched_url",
    ]  # fmt: skip


def test_a_lines_prompt_tokens_are_read_from_its_answers_usage():
    from pipepool.jobs.batch_lines import prompt_tokens

    vectors = b'{"data":[{"embedding":[' + b"0.125," * 5000 + b"0.5]}],"
    assert prompt_tokens(vectors + b'"usage":{"prompt_tokens":12,"total_tokens":12}}') == 12
    cohere = b'{"embeddings":{},"meta":{"billed_units":{"input_tokens":7}}}'
    assert prompt_tokens(cohere) == 7
    assert prompt_tokens(b'{"error":{"message":"no usage here"}}') == 0


def test_files_expire_as_openai_says_and_a_batch_sets_its_outputs_expiry(client):
    kept = {"anchor": "created_at", "seconds": 3600}
    source = client.files.create(
        file=("expiring.jsonl", jsonl(embedding_lines(3, "exp"))),
        purpose="batch",
        expires_after=kept,
    )
    assert source.expires_at == source.created_at + 3600
    assert client.files.retrieve(source.id).expires_at == source.expires_at
    created = client.batches.create(
        input_file_id=source.id,
        endpoint="/v1/embeddings",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )
    batch = wait_batch(client, created.id)
    output = client.files.retrieve(batch.output_file_id)
    assert output.expires_at == output.created_at + 7200
    for bad in (
        {"anchor": "created_at", "seconds": 60},
        {"anchor": "last_active_at", "seconds": 3600},
    ):
        with pytest.raises(openai.BadRequestError):
            client.files.create(file=("x.jsonl", b"{}\n"), purpose="batch", expires_after=bad)


def test_an_expired_file_is_gone_unless_a_running_batch_reads_it(tmp_path, monkeypatch):
    from pipepool.server.batch_store import BatchStore

    store = BatchStore(tmp_path)
    ids = []
    for name in ("read-by-a-batch", "alone", "kept"):
        file_id, part = store.new_upload()
        part.write_bytes(b"{}\n")
        expiry = None if name == "kept" else 3600
        ids.append(store.add_file(file_id, part, filename=name, purpose="batch",
                                  expires_after_s=expiry).id)  # fmt: skip
    store.create_batch(ids[0], "/v1/embeddings", "24h", None)  # validating: unfinished
    later = time.time() + 3601
    monkeypatch.setattr(time, "time", lambda: later)
    assert store.file(ids[0]) is None and store.file(ids[1]) is None
    assert store.file(ids[2]) is not None
    assert [r.id for r in store.list_files(None, None, 10, newest_first=False)[0]] == [ids[2]]
    assert store.delete_expired() == 1  # not the running batch's input
    assert not store.path(ids[1]).exists() and store.path(ids[0]).exists()
    store.close()
