"""``pipepool embed --input CORPUS --output-dir DIR``: a .jsonl, .parquet or .txt corpus into
parquet shards whose vectors are ``Engine.embed``'s, resumable after SIGINT or SIGKILL with
the output of an uninterrupted run and no finished shard rewritten; a manifest of other
settings is refused naming them; bad rows are error rows and the job goes on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tiny_models import SENTENCES

import pipepool
from pipepool.commands.cli import main
from pipepool.jobs.corpus_files import atomic_write, locked
from pipepool.jobs.corpus_input import Corpus
from pipepool.jobs.corpus_rows import CorpusSpec
from pipepool.jobs.corpus_shards import read_shard

MIN_COSINE = 0.99999
ROWS = 300
SHARD = 64  # not a divisor of ROWS: the last shard is short
TEXTS = [f"{SENTENCES[i % len(SENTENCES)]} (row {i})" for i in range(ROWS)]


@pytest.fixture(scope="module")
def expected(bert_path) -> np.ndarray:
    with pipepool.Engine(str(bert_path)) as engine:
        return engine.embed(TEXTS)


def _job(bert_path, corpus: Path, out: Path, *args: str, shard_size: int = SHARD) -> int:
    flags = ["--model", str(bert_path), "--no-progress", "--input", str(corpus)]
    return main(["embed", *flags, "--output-dir", str(out), "--shard-size", str(shard_size), *args])


def _shards(out: Path) -> list[Path]:
    return sorted(out.glob("part-*.parquet"))


def _read_all(out: Path) -> tuple[list, np.ndarray]:
    ids: list = []
    vectors = []
    for path in _shards(out):
        shard_ids, shard_vectors = read_shard(path)
        ids += shard_ids
        vectors.append(shard_vectors)
    return ids, np.concatenate(vectors)


def _assert_close(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape
    cos = np.sum(actual * expected, axis=1) / (
        np.linalg.norm(actual, axis=1) * np.linalg.norm(expected, axis=1)
    )
    assert cos.min() >= MIN_COSINE, cos.min()


def _write_corpus(path: Path, rows: list[dict]) -> None:
    if path.suffix == ".parquet":
        # Row groups of 50 rows: shards of 64 start and end inside them.
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=50)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    else:
        path.write_text("".join(r["text"] + "\n" for r in rows), encoding="utf-8")


# -- vectors and ids ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("suffix", "ids"),
    [
        (".jsonl", [f"doc-{i}" for i in range(ROWS)]),
        (".parquet", [3 * i for i in range(ROWS)]),
        (".txt", list(range(1, ROWS + 1))),  # a .txt line's id is its line number
    ],
)
def test_corpus_shards_hold_engine_vectors_with_their_ids_in_order(
    bert_path, expected, tmp_path, suffix, ids
):
    corpus = tmp_path / f"corpus{suffix}"
    _write_corpus(corpus, [{"id": i, "text": t} for i, t in zip(ids, TEXTS, strict=True)])
    out = tmp_path / "out"
    assert _job(bert_path, corpus, out) == 0
    assert [p.name for p in _shards(out)] == [f"part-{k:05d}.parquet" for k in range(5)]
    got_ids, vectors = _read_all(out)
    assert got_ids == ids
    _assert_close(vectors, expected)
    schema = pq.read_schema(_shards(out)[0])
    assert schema.field("id").type == (pa.string() if suffix == ".jsonl" else pa.int64())
    assert schema.field("embedding").type == pa.list_(pa.float32(), 64)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["completed"]["rows"] == manifest["completed"]["vectors"] == ROWS
    assert manifest["settings"]["resolved_dim"] == 64
    assert not list(out.glob("errors-*"))


def test_jsonl_without_the_id_field_takes_row_numbers_as_ids(bert_path, expected, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    _write_corpus(corpus, [{"body": t} for t in TEXTS[:10]])
    out = tmp_path / "out"
    assert _job(bert_path, corpus, out, "--text-field", "body") == 0
    ids, vectors = _read_all(out)
    assert ids == list(range(1, 11))
    _assert_close(vectors, expected[:10])


# -- resuming ----------------------------------------------------------------------------------


def _popen(bert_path, corpus: Path, out: Path, shard_size: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPEPOOL_")}
    env["PYTHONPATH"] = str(Path(pipepool.__file__).parents[1])
    command = [sys.executable, "-m", "pipepool", "embed", "--model", str(bert_path)]
    command += ["--input", str(corpus), "--output-dir", str(out), "--no-progress"]
    return subprocess.Popen(
        [*command, "--shard-size", str(shard_size)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        # A shell's background job ignores SIGINT, and a child inherits that: undo it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _wait_for_shards(proc: subprocess.Popen, out: Path, more_than: int) -> None:
    """Until ``out`` holds more than ``more_than`` shards (the process still running)."""
    deadline = time.monotonic() + 120
    while len(_shards(out)) <= more_than:
        assert proc.poll() is None, f"the job ended first:\n{proc.communicate()[1]}"
        assert time.monotonic() < deadline, "no new shard in 120 s"
        time.sleep(0.005)


def _stats(paths: list[Path]) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in paths}


@pytest.mark.slow
def test_sigint_then_sigkill_then_rerun_gives_the_uninterrupted_output(bert_path, tmp_path):
    rows = 3000
    corpus = tmp_path / "corpus.jsonl"
    lines = [
        {"id": i, "text": f"{SENTENCES[i % len(SENTENCES)]} #{i}"} if i % 250 else {"id": i}
        for i in range(rows)
    ]
    _write_corpus(corpus, lines)
    shard_size, num_shards = 100, 30  # enough shards that a signal lands mid-job

    reference = tmp_path / "reference"
    proc = _popen(bert_path, corpus, reference, shard_size)
    assert proc.wait(timeout=300) == 0, proc.communicate()[1]

    out = tmp_path / "out"
    proc = _popen(bert_path, corpus, out, shard_size)
    _wait_for_shards(proc, out, more_than=0)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130, proc.communicate()[1]
    after_sigint = _stats(_shards(out))
    assert 0 < len(after_sigint) < num_shards
    assert not list(out.glob(".*.tmp")), "Ctrl-C left a partial file"

    proc = _popen(bert_path, corpus, out, shard_size)
    _wait_for_shards(proc, out, more_than=len(after_sigint))
    proc.kill()
    proc.wait(timeout=60)
    after_sigkill = _stats(_shards(out))
    assert len(after_sigint) < len(after_sigkill) < num_shards
    # What SIGKILL may leave halfway through a write; the rerun removes it.
    leftover = out / ".part-00029.parquet.0123abcd.tmp"
    leftover.write_bytes(b"half a shard")

    proc = _popen(bert_path, corpus, out, shard_size)
    stderr = proc.communicate(timeout=300)[1]
    assert proc.returncode == 0, stderr
    assert "resuming" in stderr
    assert not leftover.exists()
    final = _stats(_shards(out))
    assert len(final) == num_shards
    for name, stat in after_sigkill.items():
        assert final[name] == stat, f"{name} was written again"
    assert {n: after_sigkill[n] for n in after_sigint} == after_sigint

    # Bit for bit: a shard of 100 texts reaches the engine as one intake slice, so its steps
    # are planned from all its rows at once, the same in every run. (A shard of more texts
    # than a slice holds is planned as its slices arrive: equal to float rounding only, as
    # between two uninterrupted runs; benchmarks/corpus_job.py measures it.)
    for a, b in zip(_shards(reference), _shards(out), strict=True):
        ids_a, vectors_a = read_shard(a)
        ids_b, vectors_b = read_shard(b)
        assert ids_a == ids_b
        np.testing.assert_array_equal(vectors_a, vectors_b)
    errors = sorted(p.name for p in reference.glob("errors-*.jsonl"))
    assert errors == sorted(p.name for p in out.glob("errors-*.jsonl"))
    assert len(errors) == 12  # ids 0, 250, ... have no text: 12 shards with an error row
    for name in errors:
        assert (out / name).read_text() == (reference / name).read_text()
    done = json.loads((out / "manifest.json").read_text())["completed"]
    assert done == json.loads((reference / "manifest.json").read_text())["completed"]
    assert (done["rows"], done["vectors"], done["errors"]) == (rows, rows - 12, 12)


def test_a_finished_job_rerun_is_already_complete(bert_path, tmp_path):
    corpus = tmp_path / "corpus.txt"
    _write_corpus(corpus, [{"text": t} for t in TEXTS[:100]])
    out = tmp_path / "out"
    assert _job(bert_path, corpus, out) == 0
    before = _stats([*_shards(out), out / "manifest.json"])
    assert _job(bert_path, corpus, out) == 0
    assert _stats([*_shards(out), out / "manifest.json"]) == before


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--dimensions", "32"], "--dimensions"),
        (["--text-field", "body"], "--text-field"),
        (["--shard-size", "50"], "--shard-size"),
        (["--normalize"], "--normalize"),
    ],
)
def test_a_manifest_of_other_settings_is_refused_naming_them(
    bert_path, tmp_path, capsys, flags, named
):
    corpus = tmp_path / "corpus.jsonl"
    _write_corpus(corpus, [{"id": i, "text": t, "body": t} for i, t in enumerate(TEXTS[:100])])
    out = tmp_path / "out"
    assert _job(bert_path, corpus, out, "--no-normalize") == 0
    (out / "part-00001.parquet").unlink()  # unfinished: a rerun would write it
    before = _stats([*_shards(out), out / "manifest.json"])
    capsys.readouterr()
    # The first run's --no-normalize, unless this one says otherwise; a second --shard-size
    # overrides _job's own (argparse takes the last).
    args = flags if flags == ["--normalize"] else ["--no-normalize", *flags]
    assert _job(bert_path, corpus, out, *args) == 2
    err = capsys.readouterr().err
    assert "manifest.json was written with other settings" in err
    assert f"{named}:" in err
    assert _stats([*_shards(out), out / "manifest.json"]) == before


def test_an_edited_corpus_is_refused(bert_path, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    _write_corpus(corpus, [{"text": t} for t in TEXTS[:100]])
    out = tmp_path / "out"
    assert _job(bert_path, corpus, out) == 0
    with open(corpus, "a", encoding="utf-8") as f:
        f.write("one more line\n")
    capsys.readouterr()
    assert _job(bert_path, corpus, out) == 2
    assert "input_fingerprint:" in capsys.readouterr().err


def test_a_job_that_fails_before_its_first_shard_leaves_no_manifest(bert_path, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    _write_corpus(corpus, [{"text": t} for t in TEXTS[:10]])
    out = tmp_path / "out"
    assert _job(bert_path, corpus, out, "--dimensions", "65") == 2  # the model gives 64
    assert "dimensions=65 is larger" in capsys.readouterr().err
    assert not (out / "manifest.json").exists()
    assert _job(bert_path, corpus, out, "--dimensions", "32") == 0
    assert read_shard(_shards(out)[0])[1].shape == (10, 32)


def test_shards_without_a_manifest_are_refused(bert_path, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    _write_corpus(corpus, [{"text": t} for t in TEXTS[:100]])
    out = tmp_path / "out"
    assert _job(bert_path, corpus, out) == 0
    (out / "manifest.json").unlink()
    assert _job(bert_path, corpus, out) == 2
    assert "no manifest.json" in capsys.readouterr().err


# -- bad rows ----------------------------------------------------------------------------------


def test_bad_rows_are_error_rows_and_the_job_goes_on(bert_path, expected, tmp_path):
    good = [json.dumps({"id": f"d{i}", "text": TEXTS[i]}).encode() for i in range(6)]
    lines = [
        good[0],
        json.dumps({"id": "d-missing"}).encode(),  # row 2: no text field
        json.dumps({"id": "d-int", "text": 42}).encode(),  # row 3: not a string
        good[1],
        b'{"id": "d-bytes", "text": "caf\xe9"}',  # row 5: not valid UTF-8
        b"",  # row 6: blank
        json.dumps({"id": "d-empty", "text": ""}).encode(),  # row 7: the engine refuses it
        good[2],
        json.dumps({"id": 7, "text": "an integer id"}).encode(),  # row 9: ids are strings
        b"[1, 2]",  # row 10: not an object
        b"{not json",  # row 11
        good[3],
        json.dumps({"id": "d-empty-2", "text": ""}).encode(),  # row 13: refused too
        good[4],
        good[5],
    ]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out"
    assert _job(bert_path, corpus, out, shard_size=8) == 0
    ids, vectors = _read_all(out)
    assert ids == [f"d{i}" for i in range(6)]
    _assert_close(vectors, expected[:6])
    errors = [
        json.loads(line)
        for path in sorted(out.glob("errors-*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    assert [(e["row"], e["id"]) for e in errors] == [
        (2, "d-missing"),
        (3, "d-int"),
        (5, None),
        (6, None),
        (7, "d-empty"),
        (9, None),
        (10, None),
        (11, None),
        (13, "d-empty-2"),
    ]
    messages = {e["row"]: e["error"] for e in errors}
    assert messages[2] == "no 'text' field"
    assert messages[3] == "'text' is an integer, not a string"
    assert messages[5].startswith("not valid UTF-8 (byte 0xe9")
    assert messages[6] == "a blank line, not a JSON object"
    assert messages[7] == messages[13] == "the text is an empty string"
    assert "this corpus's ids are strings" in messages[9]
    assert messages[10] == "expected a JSON object, got an array"
    assert messages[11].startswith("not valid JSON")
    assert [p.name for p in sorted(out.glob("errors-*"))] == [
        "errors-00000.jsonl",
        "errors-00001.jsonl",
    ]
    done = json.loads((out / "manifest.json").read_text())["completed"]
    assert (done["rows"], done["vectors"], done["errors"]) == (15, 6, 9)


def test_txt_lines_that_are_not_utf8_are_error_rows_named_by_line(bert_path, expected, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(f"{TEXTS[0]}\r\ncaf\xe9\n{TEXTS[1]}\n".encode("latin-1"))
    out = tmp_path / "out"
    assert _job(bert_path, corpus, out) == 0
    ids, vectors = _read_all(out)
    assert ids == [1, 3]
    _assert_close(vectors, expected[:2])
    [error] = [json.loads(x) for x in (out / "errors-00000.jsonl").read_text().splitlines()]
    assert (error["row"], error["id"]) == (2, 2)


# -- reading in shards, writing whole files (no engine) ---------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".txt"])
def test_skipped_shards_leave_the_others_the_same_rows(tmp_path, suffix):
    corpus = tmp_path / f"corpus{suffix}"
    _write_corpus(corpus, [{"id": 10 * i, "text": f"text {i}"} for i in range(95)])
    source = Corpus(CorpusSpec(corpus))
    every = list(source.shards(10))
    assert [s.num_rows for s in every] == [10] * 9 + [5]
    skip = {0, 1, 2, 5, 9}
    some = list(source.shards(10, skip=skip))
    assert [s.index for s in some] == list(range(10))
    for a, b in zip(every, some, strict=True):
        assert a.num_rows == b.num_rows and a.first_row == b.first_row
        if b.skipped:
            assert a.index in skip
        else:
            assert (a.rows, a.ids, a.texts) == (b.rows, b.ids, b.texts)
    assert every[3].rows == list(range(31, 41))


def test_parquet_column_problems_are_refused_before_reading(tmp_path):
    corpus = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"id": [1.5], "text": ["a"]}), corpus)
    with pytest.raises(pipepool.InvalidInputError, match="ids must be integers or strings"):
        Corpus(CorpusSpec(corpus))
    with pytest.raises(pipepool.InvalidInputError, match="no column 'body'"):
        Corpus(CorpusSpec(corpus, text_field="body"))


def test_an_interrupted_write_leaves_the_old_file_and_no_partial_one(tmp_path):
    target = tmp_path / "part-00000.parquet"
    target.write_bytes(b"old")

    def write(f) -> None:
        f.write(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, write)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["part-00000.parquet"]


# -- the command line --------------------------------------------------------------------------


def test_a_second_job_in_the_same_folder_is_refused(bert_path, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    _write_corpus(corpus, [{"text": t} for t in TEXTS[:10]])
    out = tmp_path / "out"
    out.mkdir()
    with locked(out):
        assert _job(bert_path, corpus, out) == 2
    assert "another job is writing into" in capsys.readouterr().err
    assert not _shards(out)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--output", "x.npy"], "does not take --output"),
        (["--output-type", "sparse"], "does not take --output-type sparse"),
        (["some text"], "does not take TEXT arguments"),
    ],
)
def test_output_dir_refuses_what_it_does_not_take(tmp_path, capsys, args, said):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a text\n")
    argv = ["embed", "--input", str(corpus), "--output-dir", str(tmp_path / "out"), *args]
    assert main(argv) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_output_dir_needs_an_input_file(tmp_path, capsys):
    assert main(["embed", "--input", "-", "--output-dir", str(tmp_path / "out")]) == 2
    assert "needs --input FILE" in capsys.readouterr().err


def test_without_pyarrow_the_jobs_extra_is_named(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a text\n")
    code = (
        "import sys\n"
        "sys.modules['pyarrow'] = None  # importing it now raises ModuleNotFoundError\n"
        "from pipepool.commands.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    argv = ["embed", "--input", str(corpus), "--output-dir", str(tmp_path / "out")]
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'pipepool[jobs]'" in proc.stderr
    assert not (tmp_path / "out").exists()
