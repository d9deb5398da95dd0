"""One rule for empty and blank inputs (docs/python-api.md, "Empty and blank inputs"), a test
per path: a blank text is a text everywhere; the empty string is refused by name, except by
the sentence-transformers methods, which embed it as the special tokens alone; a blank line of
a line file is no record. The server's side is in tests/test_server.py
(``test_an_empty_text_is_400_and_a_blank_one_is_a_text``)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

import pipepool
from pipepool.commands.cli import main

BLANK = " \t "


@pytest.fixture(scope="module")
def engine(minilm_path):
    with pipepool.Engine(str(minilm_path), device="cpu") as e:
        yield e


def test_python_api(engine):
    with pytest.raises(pipepool.InvalidInputError, match="input 1 is an empty string") as e:
        engine.embed(["a", ""])
    assert (e.value.param, e.value.index) == ("input", 1)
    with pytest.raises(pipepool.InvalidInputError, match="input 0 is an empty string"):
        engine.tokenize("")
    (special,) = engine.tokenize(BLANK)  # MiniLM's tokenizer keeps no whitespace
    assert len(special) == 2
    blank = engine.embed([BLANK])
    np.testing.assert_allclose(blank, engine.embed([special]), rtol=0, atol=1e-6)
    # sentence-transformers' encode embeds "" as the special tokens alone, as it does.
    np.testing.assert_allclose(
        pipepool.SentenceTransformer(engine).encode([""]), blank, rtol=0, atol=1e-6
    )


def _embed(model, *args: str) -> int:
    return main(["embed", "--model", str(model), "--no-progress", *args])


def test_command_line_texts_and_lines(engine, minilm_path, tmp_path, capsys):
    assert _embed(minilm_path, "a", "") != 0
    assert "TEXT argument 2" in capsys.readouterr().err
    target = tmp_path / "out.npy"
    assert _embed(minilm_path, "--output", str(target), BLANK, "a") == 0
    np.testing.assert_allclose(np.load(target), engine.embed([BLANK, "a"]), rtol=0, atol=1e-6)
    source = tmp_path / "in.txt"
    source.write_text(f"a\n\n{BLANK}\nb\n")
    assert _embed(minilm_path, "--input", str(source), "--output", str(target)) == 0
    assert "skipped 2 blank lines" in capsys.readouterr().err
    np.testing.assert_allclose(np.load(target), engine.embed(["a", "b"]), rtol=0, atol=1e-6)


def _corpus_job(model, corpus, out) -> tuple[list, dict[int, str]]:
    flags = ["--input", str(corpus), "--output-dir", str(out)]
    assert _embed(model, *flags) == 0
    ids = [
        i for p in sorted(out.glob("part-*.parquet")) for i in pq.read_table(p)["id"].to_pylist()
    ]
    errors = [
        json.loads(x) for p in out.glob("errors-*.jsonl") for x in p.read_text().split("\n") if x
    ]
    return ids, {e["row"]: e["error"] for e in errors}


def test_corpus_job(minilm_path, tmp_path):
    txt = tmp_path / "corpus.txt"
    txt.write_text(f"a\n\n{BLANK}\nb\n")
    ids, errors = _corpus_job(minilm_path, txt, tmp_path / "txt")
    assert ids == [1, 4]
    assert errors == {2: "a blank line, no text", 3: "a blank line, no text"}
    rows = [{"id": "x", "text": "a"}, {"id": "e", "text": ""}, {"id": "w", "text": BLANK}]
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    ids, errors = _corpus_job(minilm_path, jsonl, tmp_path / "jsonl")
    assert ids == ["x", "w"]  # a blank value is a text
    assert errors == {2: "the text is an empty string", 4: "a blank line, not a JSON object"}
