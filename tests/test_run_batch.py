"""``pipepool run-batch``, offline: every line of a batch file answered as the server's route
answers it (vectors of the engine, bad lines with their errors in the same file, as vLLM's
run-batch writes them), and a run interrupted by SIGKILL or Ctrl-C, run again, ends with the
same lines as an uninterrupted run, each custom_id exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from tiny_models import MIN_COSINE, SENTENCES, cosine

import pipepool
from pipepool.jobs.batch_lines import LineChecker, WrittenLines

LINES = 400  # good requests in the file
# One request a step: answers come out one at a time for hundreds of steps after the last line
# is read and sent (the first write follows the reading of a window of lines), so that a run is
# caught half-way however fast the engine is next to the reader.
ENGINE_ARGS = ["--max-num-batched-tokens", "256", "--max-num-seqs", "1"]
BAD = [
    b"{not json",
    json.dumps({"custom_id": "req-1", "method": "POST", "url": "/v1/embeddings",
                "body": {"input": "a repeat"}}).encode(),
    json.dumps({"custom_id": "wrong-url", "method": "POST", "url": "/v1/chat/completions",
                "body": {}}).encode(),
    json.dumps({"custom_id": "wrong-body", "method": "POST", "url": "/v1/embeddings",
                "body": {"input": []}}).encode(),
]  # fmt: skip


def texts_of(i: int) -> list[str]:
    text = f"{SENTENCES[i % len(SENTENCES)]} (request {i})"
    return [text, SENTENCES[(i + 3) % len(SENTENCES)]] if i % 7 == 0 else [text]


@pytest.fixture(scope="module")
def batch_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("run-batch") / "batch.jsonl"
    with open(path, "wb") as f:
        for i in range(LINES):
            body = {"model": "all-MiniLM-L6-v2", "input": texts_of(i)}
            line = {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/embeddings"}
            f.write(json.dumps({**line, "body": body}).encode() + b"\n")
            if i % 100 == 50:
                f.write(BAD[i // 100] + b"\n")
    return path


def command(batch: Path, output: Path, engine_args: list[str] = ENGINE_ARGS) -> list[str]:
    return [sys.executable, "-m", "pipepool", "run-batch", "-i", str(batch), "-o", str(output),
            *engine_args]  # fmt: skip


def run_batch(batch: Path, output: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(command(batch, output), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def read(output: Path) -> list[dict]:
    return [json.loads(x) for x in output.read_bytes().splitlines()]


def by_custom_id(lines: list[dict]) -> dict:
    """custom_id (None for lines that had none) -> its output line; each at most once, but
    the error line of a repeated custom_id, kept apart."""
    found = {}
    for x in lines:
        key = x["custom_id"]
        if (x["error"] or {}).get("code") == "duplicate_custom_id":
            key = ("repeat", key)
        assert key not in found, f"{key} twice"
        found[key] = x
    return found


@pytest.fixture(scope="module")
def uninterrupted_run(batch_file, tmp_path_factory) -> tuple[dict, str]:
    """The uninterrupted run's output lines by custom_id, and what it printed to stderr."""
    output = tmp_path_factory.mktemp("whole") / "out.jsonl"
    done = run_batch(batch_file, output)
    return by_custom_id(read(output)), done.stderr


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run) -> dict:
    return uninterrupted_run[0]


def test_progress_says_what_loads_and_counts_the_lines(uninterrupted_run, batch_file):
    lines, stderr = uninterrupted_run
    total = sum(1 for x in batch_file.read_bytes().splitlines() if x.strip())
    assert "run-batch: loading " in stderr
    assert f"model loaded; {total:,} of {total:,} lines to answer" in stderr
    failed = sum(
        x["error"] is not None or x["response"]["status_code"] != 200 for x in lines.values()
    )
    assert f"run-batch: {total:,}/{total:,} lines (100.0%), {failed:,} failed" in stderr


def vectors(line: dict) -> np.ndarray:
    return np.array([d["embedding"] for d in line["response"]["body"]["data"]], dtype=np.float32)


def assert_same_output(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for key, line in got.items():
        other = expected[key]
        if line["error"] is not None:
            assert line["error"]["code"] == other["error"]["code"]
        elif line["response"]["status_code"] != 200:
            assert line["response"] == {
                **other["response"],
                "request_id": line["response"]["request_id"],
            }
        else:
            assert cosine(vectors(line), vectors(other)).min() >= MIN_COSINE


def test_every_line_is_answered_as_the_route_answers_it(uninterrupted, minilm_path):
    good = {f"req-{i}" for i in range(LINES)}
    assert set(uninterrupted) == {*good, None, ("repeat", "req-1"), "wrong-url", "wrong-body"}
    with pipepool.Engine(str(minilm_path)) as engine:
        for i in range(LINES):
            line = uninterrupted[f"req-{i}"]
            assert line["error"] is None and line["response"]["status_code"] == 200
            assert line["id"].startswith("batch_req_")
            expected = engine.embed(texts_of(i))
            assert cosine(vectors(line), expected).min() >= MIN_COSINE
    assert uninterrupted[None]["error"]["code"] == "invalid_json_line"
    assert uninterrupted["wrong-url"]["error"]["code"] == "invalid_url"
    refused = uninterrupted["wrong-body"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "input"


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGINT], ids=["sigkill", "sigint"])
def test_an_interrupted_run_resumes_to_the_uninterrupted_output(
    how, batch_file, uninterrupted, tmp_path
):
    output = tmp_path / "out.jsonl"
    proc = subprocess.Popen(
        command(batch_file, output), stderr=subprocess.PIPE, text=True,
        # A test run started as a background job (no job control) ignores SIGINT, and a child
        # inherits that: Python would then leave it ignored and the run would finish.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not (output.exists() and output.stat().st_size > 0):
        assert proc.poll() is None and time.monotonic() < deadline, "no line was written"
        time.sleep(0.01)
    proc.send_signal(how)
    _, stderr = proc.communicate(timeout=120)
    if how == signal.SIGINT:
        assert proc.returncode == 130 and "run the same command again" in stderr, stderr
    else:
        assert proc.returncode == -signal.SIGKILL
    written = len(output.read_bytes().splitlines())
    assert 0 < written < len(uninterrupted), "the run was not caught half-way"

    again = run_batch(batch_file, output)
    assert "resuming" in again.stderr
    assert_same_output(by_custom_id(read(output)), uninterrupted)


def test_a_torn_last_line_is_dropped_and_answered_again(batch_file, uninterrupted, tmp_path):
    output = tmp_path / "out.jsonl"
    head = list(uninterrupted.values())[:10]
    torn = json.dumps(list(uninterrupted.values())[10]).encode()[:40]
    output.write_bytes(b"".join(json.dumps(x).encode() + b"\n" for x in head) + torn)
    run_batch(batch_file, output)
    lines = read(output)
    assert lines[:10] == head  # kept as they were
    assert_same_output(by_custom_id(lines), uninterrupted)


def test_an_output_file_of_something_else_is_not_touched(batch_file, tmp_path):
    output = tmp_path / "notes.txt"
    output.write_bytes(b"my notes\n")
    done = subprocess.run(command(batch_file, output), capture_output=True, text=True)
    assert done.returncode == 2 and "not a batch output line" in done.stderr
    assert output.read_bytes() == b"my notes\n"


def test_without_the_server_extras_the_error_names_them(batch_file, tmp_path):
    code = (
        "import sys\n"
        "sys.modules['fastapi'] = None\n"
        "from pipepool.commands.cli import main\n"
        f"sys.exit(main(['run-batch', '-i', {str(batch_file)!r}, '-o', "
        f"{str(tmp_path / 'o.jsonl')!r}]))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPEPOOL_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 2 and "pipepool[server]" in done.stderr, done.stderr


def test_written_lines_skip_what_an_output_holds(tmp_path):
    output = tmp_path / "out.jsonl"
    rows = [
        {"custom_id": "a", "error": None},
        {"custom_id": None, "error": {"code": "invalid_json_line"}},
        {"custom_id": "a", "error": {"code": "duplicate_custom_id"}},
    ]
    output.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows) + b'{"custom')
    written = WrittenLines.of_output(output)
    assert written.count == 3 and output.read_bytes().endswith(b"}\n")
    checker = LineChecker()
    lines = [b"x", b'{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {}}',
             b"y", *[b'{"custom_id": "a"}'] * 2, b'{"custom_id": "b"}']  # fmt: skip
    skipped = [written.skip(checker.check(n, raw)) for n, raw in enumerate(lines, 1)]
    assert skipped == [True, True, False, True, False, False]
    assert Counter(skipped)[True] == written.count


def test_rerank_and_score_lines_on_a_cross_encoder(cross_encoder_path, tmp_path):
    queries = [SENTENCES[i] for i in range(4)]
    documents = [SENTENCES[10 + i : 14 + i] for i in range(4)]
    lines = []
    for i, (query, docs) in enumerate(zip(queries, documents, strict=True)):
        lines.append({"custom_id": f"rerank-{i}", "method": "POST", "url": "/v1/rerank",
                      "body": {"query": query, "documents": docs}})  # fmt: skip
        lines.append({"custom_id": f"score-{i}", "method": "POST", "url": "/v1/score",
                      "body": {"text_1": query, "text_2": docs}})  # fmt: skip
    batch, output = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    batch.write_bytes(b"".join(json.dumps(x).encode() + b"\n" for x in lines))
    done = subprocess.run(
        command(batch, output, ["--model", str(cross_encoder_path)]),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    answers = {x["custom_id"]: x["response"] for x in read(output)}
    assert len(answers) == 2 * len(queries)
    with pipepool.Engine(str(cross_encoder_path)) as engine:
        for i, (query, docs) in enumerate(zip(queries, documents, strict=True)):
            expected = engine.score(query, docs)
            assert answers[f"rerank-{i}"]["status_code"] == 200
            ranked = answers[f"rerank-{i}"]["body"]["results"]
            assert [r["index"] for r in ranked] == np.argsort(-expected, kind="stable").tolist()
            got = [r["relevance_score"] for r in sorted(ranked, key=lambda r: r["index"])]
            assert np.abs(np.array(got) - expected).max() <= 1e-4
            scores = [d["score"] for d in answers[f"score-{i}"]["body"]["data"]]
            assert np.abs(np.array(scores) - expected).max() <= 1e-4


def test_cohere_embed_lines_v1_and_v2(minilm_path, tmp_path):
    texts = [SENTENCES[i] for i in range(5)]
    lines = [
        {"custom_id": "v1", "method": "POST", "url": "/v1/embed", "body": {"texts": texts}},
        {"custom_id": "v2", "method": "POST", "url": "/v2/embed",
         "body": {"texts": texts, "input_type": "search_document", "embedding_types": ["float"]}},
    ]  # fmt: skip
    batch, output = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    batch.write_bytes(b"".join(json.dumps(x).encode() + b"\n" for x in lines))
    done = subprocess.run(
        command(batch, output, ["--model", str(minilm_path)]),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    answers = {x["custom_id"]: x["response"] for x in read(output)}
    assert answers["v1"]["status_code"] == answers["v2"]["status_code"] == 200
    with pipepool.Engine(str(minilm_path)) as engine:
        expected = engine.embed(texts)
    got = {
        "v1": answers["v1"]["body"]["embeddings"],
        "v2": answers["v2"]["body"]["embeddings"]["float"],
    }
    for vectors in got.values():
        assert len(vectors) == len(texts)
        for row, want in zip(vectors, expected, strict=True):
            assert cosine(np.array(row), want) >= MIN_COSINE
