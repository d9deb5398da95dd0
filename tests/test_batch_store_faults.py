"""The Batch store under faults, on real ``pipepool serve`` processes driven over HTTP by the
official openai client: a full disk (a small tmpfs) stalls a batch, says so on /health and
/metrics and answers uploads 507, and freeing space lets the batch finish by itself; the input
of a running batch cannot be deleted (409 naming it: ``test_batches.py`` kills that server
mid-batch and finds every custom_id once after the restart, and the database file complete
after its clean stop); a damaged store refuses the start naming the file and the recovery
command, which repairs it; uploads stream to disk in bounded memory, and their form is
OpenAI's, any other field refused by name.
Each ends with every custom_id answered exactly once, or a clear refusal."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import sqlite3
import subprocess
import sys
import time
import tracemalloc
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest
from test_batches import (
    AUTH,
    ToyApp,
    _run_until,
    _runner,
    _stored_batch,
    client_of,
    embedding_lines,
    file_lines,
    jsonl,
    line,
    serve,
    submit,
    wait_batch,
)

from pipepool.server import batch_store
from pipepool.server.batch_store import BatchStore, close_open_stores
from pipepool.server.store_admin import backup
from pipepool.server.store_check import find_problems, open_checked

# Slow: real `pipepool serve` processes, killed and restarted.
pytestmark = pytest.mark.slow

TMPFS_BYTES = 24 << 20
BIG_UPLOAD = 120 << 20  # the figure: its upload may grow the server's RSS < 60 MB
RSS_GROWTH_LIMIT = 60 << 20
LINES = 200  # a batch long enough to be caught half-way...
# ...with a window of 32 inputs in flight (half the queue): a few lines are written at a time.
SMALL_WINDOW = (
    "--max-queued-requests",
    "64",
)  # room for a few batches' outputs; a filler takes the rest


def wait_for(check, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"never got there: {what}")


def store_health(server) -> dict:
    """The store's state as /health shows it: a component not ok is named in ``components``
    and makes the server's status ``degraded`` (still 200: its models serve)."""
    r = httpx.get(server.url + "/health", timeout=10)
    assert r.status_code == 200, r.text
    store = (r.json().get("components") or {}).get("batch_store")
    if store is None:
        return {"status": "ok"}
    assert r.json()["status"] == "degraded", r.text
    return {"status": store["status"], "reason": store["detail"]}


def assert_exactly_once(client: openai.OpenAI, batch, lines: list[dict]) -> None:
    assert batch.status == "completed", batch
    outputs = file_lines(client, batch.output_file_id) + file_lines(client, batch.error_file_id)
    assert Counter(o["custom_id"] for o in outputs) == Counter(x["custom_id"] for x in lines)
    assert all(o["response"]["status_code"] == 200 for o in outputs)


@pytest.fixture
def tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(mount: Path) -> Path:
    """A file taking every free byte of ``mount``."""
    filler = mount / "filler"
    with open(filler, "wb", buffering=0) as out:
        block = b"\0" * (256 << 10)
        try:
            while True:
                out.write(block)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        try:
            while True:
                out.write(b"\0" * 512)
        except OSError:
            pass
    return filler


def test_a_full_disk_stalls_the_batch_and_freeing_space_lets_it_finish(tmpfs, tmp_path):
    """Also: the input of the stalled batch is pinned (409 naming the batch)."""
    server = serve(tmpfs / "state", tmp_path / "server.log", *SMALL_WINDOW).wait_ready()
    try:
        client = client_of(server)
        lines = embedding_lines(LINES, prefix="full")
        created = submit(client, lines)
        wait_batch(client, created.id, until=lambda b: b.request_counts.completed > 0)
        filler = fill(tmpfs)
        degraded = wait_for(lambda: store_health(server).get("status") == "degraded" or None,
                            "/health says the store is degraded")  # fmt: skip
        assert degraded
        reason = store_health(server)["reason"]
        assert "No space left on device" in reason or "SQLITE_FULL" in reason, reason
        assert server.metrics()['pipepool_component_ok{component="batch_store"}'] == 0
        stalled = client.batches.retrieve(created.id)  # reads still work
        assert stalled.status == "in_progress" and stalled.request_counts.completed < LINES
        with pytest.raises(openai.APIStatusError) as refused:
            client.files.create(file=("x.jsonl", jsonl(lines[:3])), purpose="batch")
        assert refused.value.status_code == 507, refused.value
        assert refused.value.body["code"] == "insufficient_storage"  # type: ignore[index]
        assert "free disk space" in refused.value.body["message"]  # type: ignore[index]
        with pytest.raises(openai.ConflictError) as pinned:
            client.files.delete(created.input_file_id)
        assert pinned.value.body["code"] == "file_in_use"  # type: ignore[index]
        assert created.id in pinned.value.body["message"]  # type: ignore[index]

        filler.unlink()  # nothing else: no restart, no call
        batch = wait_batch(client, created.id)
        assert_exactly_once(client, batch, lines)
        assert store_health(server) == {"status": "ok"}
        assert server.metrics()['pipepool_component_ok{component="batch_store"}'] == 1
        again = submit(client, embedding_lines(5, prefix="after"))  # new batches run too
        assert wait_batch(client, again.id).status == "completed"
        assert client.files.delete(created.input_file_id).deleted  # ended: no longer pinned
        assert "Traceback" not in server.log()  # the runner thread never died
    finally:
        server.stop()


def _store_with_files(state: Path, count: int = 3) -> list[str]:
    """A store of ``count`` uploaded files, left as a killed server leaves it (records in the
    write-ahead log); their ids."""
    script = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from pipepool.server.batch_store import BatchStore\n"
        "store = BatchStore(Path(sys.argv[1]))\n"
        "for i in range(int(sys.argv[2])):\n"
        "    file_id, part = store.new_upload()\n"
        "    part.write_bytes(b'{}\\n')\n"
        "    print(store.add_file(file_id, part, filename='a', purpose='batch').id)\n"
        "sys.stdout.flush()\n"
        "os._exit(0)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(state), str(count)],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return done.stdout.split()


def _refusal(state: Path) -> str:
    problems = find_problems(state)
    assert len(problems) == 1, problems
    return str(problems[0].error())


@pytest.mark.parametrize("damage", ["garbage-header", "zero-length", "lost-wal", "missing-db"])
def test_a_damaged_store_is_refused_naming_the_file_and_recovery_repairs_it(tmp_path, damage):
    state = tmp_path / "state"
    ids = _store_with_files(state)
    db = state / "batches.sqlite3"
    if damage == "garbage-header":
        with sqlite3.connect(db) as merged:  # its close merges the log into the file
            merged.execute("SELECT count(*) FROM files").fetchone()
        merged.close()
        with open(db, "r+b") as file:
            file.write(os.urandom(100))
    elif damage == "zero-length":
        (state / "batches.sqlite3-wal").unlink()
        db.write_bytes(b"")
    elif damage == "lost-wal":
        (state / "batches.sqlite3-wal").unlink()
    else:
        for path in state.glob("batches.sqlite3*"):
            path.unlink()
    message = _refusal(state)
    assert str(db) in message and f"pipepool batch-store recover --state-dir {state}" in message
    recovered = subprocess.run(
        [sys.executable, "-m", "pipepool", "batch-store", "recover", "--state-dir", str(state)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert recovered.returncode == 0, recovered.stderr
    assert find_problems(state) == []
    aside = next(state.glob("damaged-*"))
    assert sorted(p.name for p in (aside / "files").iterdir()) == sorted(ids)  # kept, aside
    store = open_checked(state)
    assert store is not None and store.list_files(None, None, 10, newest_first=False) == ([], False)
    close_open_stores()


def test_serve_refuses_a_damaged_store_before_serving(tmp_path):
    state = tmp_path / "state"
    _store_with_files(state, 1)
    (state / "batches.sqlite3-wal").unlink()
    (state / "batches.sqlite3").write_bytes(b"")
    done = subprocess.run(
        [sys.executable, "-m", "pipepool", "serve", "--port", "0", "--state-dir", str(state)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert str(state / "batches.sqlite3") in done.stderr and "is empty (0 bytes)" in done.stderr
    assert "pipepool batch-store recover" in done.stderr


def test_a_backup_is_a_state_directory_to_start_from(tmp_path):
    state, copy = tmp_path / "state", tmp_path / "copy"
    ids = _store_with_files(state)  # a server killed: the records are in the log alone
    assert backup(state, copy) == len(ids)
    assert find_problems(copy) == []
    store = open_checked(copy)
    assert store is not None
    assert {f.id for f in store.list_files(None, None, 10, newest_first=False)[0]} == set(ids)
    assert store.path(ids[0]).read_bytes() == b"{}\n"
    close_open_stores()


def test_a_crash_between_an_uploads_commit_and_its_rename_is_finished_at_start(tmp_path):
    store = BatchStore(tmp_path)
    file_id, part = store.new_upload()
    part.write_bytes(b"{}\n")
    store.add_file(file_id, part, filename="a", purpose="batch")
    os.replace(store.path(file_id), part)  # as if the process died before the rename
    stale, _ = store.new_upload()
    (store.files_dir / f".{stale}.part").write_bytes(b"half an upload")  # never committed
    close_open_stores()
    assert find_problems(tmp_path) == []
    reopened = open_checked(tmp_path, settled_s=0)
    assert reopened is not None and reopened.path(file_id).read_bytes() == b"{}\n"
    assert sorted(p.name for p in reopened.files_dir.iterdir()) == [file_id]
    close_open_stores()


# -- uploads: the form, as OpenAI's --------------------------------------------------------


@pytest.fixture(scope="module")
def upload_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("uploads")
    limits = ["--max-concurrent-uploads", "2", "--queue-wait", "0.5"]
    limits += ["--max-batch-file-bytes", str(BIG_UPLOAD + (1 << 20))]
    s = serve(root / "state", root / "server.log", *limits)
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"expires_after": json.dumps({"anchor": "created_at", "seconds": 3600})}, "expires_after"),
        ({"expires_after[second]": "3600", "expires_after[anchor]": "created_at"},
         "expires_after[second]"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "an hour"},
         "expires_after"),
        ({"expires_after[seconds]": "3600"}, "expires_after"),
        ({"fine_tune": "yes"}, "fine_tune"),
    ],
    ids=["json-expires_after", "misspelt-seconds", "seconds-not-a-number", "no-anchor",
         "unknown-field"],
)  # fmt: skip
def test_a_malformed_or_unknown_upload_field_is_400_naming_it(upload_server, fields, param):
    r = httpx.post(
        upload_server.url + "/v1/files",
        headers=AUTH,
        data={"purpose": "batch", **fields},
        files={"file": ("a.jsonl", b"{}\n")},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_uploads_past_the_cap_wait_then_get_429_with_retry_after(upload_server):
    import threading

    release = threading.Event()
    started = threading.Barrier(3)

    def slow_body():
        yield b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="s.jsonl"\r\n\r\n'
        started.wait(30)
        release.wait(60)
        yield b"{}\n\r\n--b--\r\n"

    answers: list[int] = []

    def slow_upload() -> None:
        headers = {**AUTH, "content-type": "multipart/form-data; boundary=b"}
        r = httpx.post(upload_server.url + "/v1/files", headers=headers, content=slow_body(),
                       timeout=60)  # fmt: skip
        answers.append(r.status_code)

    holders = [threading.Thread(target=slow_upload) for _ in range(2)]
    for t in holders:
        t.start()
    started.wait(30)
    try:
        over = None
        for _ in range(50):  # until both holders are inside the route (their first bytes read)
            small = {"file": ("o.jsonl", b"{}\n")}
            over = httpx.post(upload_server.url + "/v1/files", headers=AUTH,
                              data={"purpose": "batch"}, files=small)  # fmt: skip
            if over.status_code == 429:
                break
        assert over is not None and over.status_code == 429, over.text
        assert over.headers["retry-after"] and over.json()["error"]["code"] == "too_many_uploads"
    finally:
        release.set()
        for t in holders:
            t.join(60)
    assert answers == [200, 200]
    client = client_of(upload_server)
    assert client.files.create(file=("ok.jsonl", b"{}\n"), purpose="batch").bytes == 3


def rss_peak_since_reset(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in bytes."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return tuple(int(fields[k].split()[0]) << 10 for k in ("VmRSS", "VmHWM"))  # type: ignore[return-value]


def generated_upload(size: int, boundary: str = "pipepool-test"):
    """A multipart body holding a JSON Lines file of ``size`` bytes, made as it is sent."""
    yield (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
           f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
           'filename="big.jsonl"\r\nContent-Type: application/jsonl\r\n\r\n').encode()  # fmt: skip
    one = json.dumps(embedding_lines(1)[0]).encode() + b"\n"
    block = one * ((1 << 20) // len(one))
    sent = 0
    while sent < size:
        piece = block[: size - sent]
        sent += len(piece)
        yield piece
    yield f"\r\n--{boundary}--\r\n".encode()


@pytest.mark.slow
def test_a_120_mb_upload_streams_to_disk_in_bounded_memory(upload_server):
    pid = upload_server.proc.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak (VmHWM) starts from now
    before, _ = rss_peak_since_reset(pid)
    r = httpx.post(
        upload_server.url + "/v1/files",
        headers={**AUTH, "content-type": "multipart/form-data; boundary=pipepool-test"},
        content=generated_upload(BIG_UPLOAD),
        timeout=120,
    )
    assert r.status_code == 200, r.text
    _, peak = rss_peak_since_reset(pid)
    assert r.json()["bytes"] == BIG_UPLOAD
    grown = peak - before
    print(f"120 MB upload: server RSS {before >> 20} MB, peak {peak >> 20} MB (+{grown >> 20} MB)")
    assert grown < RSS_GROWTH_LIMIT, f"RSS grew {grown >> 20} MB"
    client_of(upload_server).files.delete(r.json()["id"])


# -- in-process: the runner on a toy app -----------------------------------------------------


def run_until(runner, done, timeout: float = 120.0) -> None:
    asyncio.run(asyncio.wait_for(_run_until(runner, done), timeout))


def test_the_runner_waits_out_a_storage_fault_and_resumes_exactly_once(tmp_path, monkeypatch):
    """The tmpfs test's promise without a mount: writes fail with ENOSPC for a while (the
    bodies' and the database's), the runner neither dies nor fails the batch, and every line
    is answered once when they succeed again."""
    store, batch_id = _stored_batch(tmp_path, 60)
    toy = ToyApp()
    full = {"on": False, "refused": 0}
    real_write, real_transaction = batch_store.write_all, BatchStore._transaction

    def write_all(fd, data):  # the bodies' writes
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    def transaction(self):  # the database's (the commit of lines, the runner's probe)
        if full["on"]:
            full["refused"] += 1
            if full["refused"] <= 3:  # ...until the runner's third try: space was freed
                raise sqlite3.OperationalError("database or disk is full")
            full["on"] = False
        return real_transaction(self)

    def on_call(count: int) -> None:
        if count == 10:
            full["on"] = True  # from the 10th line on, nothing can be written...

    toy = ToyApp(on_call)
    monkeypatch.setattr(batch_store, "write_all", write_all)
    monkeypatch.setattr(BatchStore, "_transaction", transaction)
    run_until(_runner(tmp_path, toy), lambda: store.status(batch_id) == "completed")
    final = store.batch(batch_id)
    assert final is not None and final.output_file_id is not None
    outputs = [json.loads(x) for x in store.path(final.output_file_id).read_bytes().splitlines()]
    assert sorted(o["custom_id"] for o in outputs) == sorted(f"c{i}" for i in range(60))
    assert len(toy.calls) > 60  # lines in flight at the fault ran again; each written once
    health = store.health()
    assert health.ok and health.reason is None and health.errors > 0  # it was degraded
    close_open_stores()


def test_a_huge_line_is_refused_unread_and_never_held_whole(tmp_path):
    store = BatchStore(tmp_path)
    file_id, part = store.new_upload()
    huge = line("huge", {"input": "x" * (40 << 20)})
    with open(part, "wb") as out:
        out.write(jsonl([line("before", {"input": "a"})]))
        out.write(json.dumps(huge).encode() + b"\n")
        out.write(jsonl([line("after", {"input": "b"})]))
    store.add_file(file_id, part, filename="in.jsonl", purpose="batch")
    batch_id = store.create_batch(file_id, "/v1/embeddings", "24h", None).id
    toy = ToyApp()
    tracemalloc.start()
    try:
        runner = _runner(tmp_path, toy, max_line_bytes=1 << 20)
        run_until(runner, lambda: store.status(batch_id) == "completed")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak >> 20} MB held for a 40 MB line"
    final = store.batch(batch_id)
    assert final is not None and final.error_file_id is not None
    (refused,) = [json.loads(x) for x in store.path(final.error_file_id).read_bytes().splitlines()]
    assert refused["custom_id"] == "huge" and refused["error"]["code"] == "line_too_large"
    assert toy.calls == ["a", "b"]
    close_open_stores()
