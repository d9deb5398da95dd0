"""Issue 33 item 4: ``pipepool embed --output-type sparse`` writes what ``Retriever.embed_sparse``
gives, one JSON line per input line (the line rules of ``embed``: blank lines skipped and
mapped), ``--output-type multi_vector`` what ``embed_multi_vector`` gives (.npz or .jsonl),
and an output the model cannot give is exit status 2 naming those it gives."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tiny_retrieval as tr
from tiny_models import SENTENCES

import pipepool
from pipepool.commands.cli import main
from pipepool.commands.embed import line_map_path

TEXTS = [SENTENCES[0], "the cat sat on the mat, and the cat slept.", "x", SENTENCES[3]]


@pytest.fixture(scope="module")
def splade(tmp_path_factory):
    return tr.build_splade(tmp_path_factory.mktemp("cli-splade") / "splade")


@pytest.fixture(scope="module")
def colbert(tmp_path_factory):
    return tr.build_pylate(tmp_path_factory.mktemp("cli-colbert") / "colbert")


def _embed(model, *args: str) -> int:
    return main(["embed", "--model", str(model), "--no-progress", *args])


def _read_jsonl(path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(len(rows)))
    return rows


def _same_sparse(row: dict, expected) -> None:
    """Same ids; weights within 1e-5 of the vector's largest (absolute: a weight near 0 may move
    by a large relative amount in float32 between two batchings)."""
    np.testing.assert_array_equal(row["indices"], expected.indices)
    scale = float(np.abs(expected.values).max()) if len(expected.values) else 1.0
    np.testing.assert_allclose(row["values"], expected.values, rtol=0, atol=1e-5 * scale)


def test_sparse_jsonl_equals_embed_sparse_line_for_line(splade, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("\n".join([TEXTS[0], "", *TEXTS[1:], "  "]) + "\n")  # blanks skipped
    target = tmp_path / "out.jsonl"
    assert _embed(splade, "--input", str(source), "--output-type", "sparse", "--output",
                  str(target)) == 0  # fmt: skip
    with pipepool.Engine(str(splade)) as engine:
        expected = pipepool.Retriever(engine).embed_sparse(TEXTS)
        top = pipepool.Retriever(engine).embed_sparse(TEXTS, top_k=4)
    rows = _read_jsonl(target)
    assert [r["text"] for r in rows] == TEXTS
    assert all(set(r) == {"index", "text", "indices", "values"} for r in rows)
    for row, vector in zip(rows, expected, strict=True):
        _same_sparse(row, vector)
    assert line_map_path(target).read_text() == "1\n3\n4\n5\n"

    assert _embed(splade, *TEXTS, "--output-type", "sparse", "--top-k", "4", "--no-text",
                  "--output", str(target)) == 0  # fmt: skip
    rows = _read_jsonl(target)
    assert all(set(r) == {"index", "indices", "values"} for r in rows)
    for row, vector in zip(rows, top, strict=True):
        _same_sparse(row, vector)


def test_sparse_without_output_prints_json_lines(splade, capsys):
    assert _embed(splade, *TEXTS[:2], "--output-type", "sparse") == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["text"] for r in rows] == TEXTS[:2]
    assert "sparse vectors" in err


def test_multi_vector_npz_and_jsonl_equal_embed_multi_vector(colbert, tmp_path):
    with pipepool.Engine(str(colbert)) as engine:
        documents = pipepool.Retriever(engine).embed_multi_vector(TEXTS)
        queries = pipepool.Retriever(engine).embed_multi_vector(TEXTS, is_query=True)
    npz = tmp_path / "docs.npz"
    assert _embed(colbert, *TEXTS, "--output-type", "multi_vector", "--output", str(npz)) == 0
    with np.load(npz) as saved:
        assert saved.files == [str(i) for i in range(len(TEXTS))]
        for i, expected in enumerate(documents):
            np.testing.assert_allclose(saved[str(i)], expected, rtol=0, atol=1e-6)
    jsonl = tmp_path / "queries.jsonl"
    assert _embed(colbert, *TEXTS, "--output-type", "multi_vector", "--is-query", "--output",
                  str(jsonl)) == 0  # fmt: skip
    for row, expected in zip(_read_jsonl(jsonl), queries, strict=True):
        np.testing.assert_allclose(row["multi_vector"], expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "which,args,message",
    [
        ("colbert", ["--output-type", "sparse"], "does not give sparse outputs; it gives "
         "multi_vector"),
        ("splade", ["--output-type", "multi_vector"], "it gives sparse"),
        ("splade", ["--output-type", "sparse", "--output", "x.npy"], "must end in .jsonl"),
        ("splade", ["--output-type", "sparse", "--dimensions", "8"], "dense vectors only"),
    ],
)  # fmt: skip
def test_an_output_the_model_cannot_give_exits_2(request, which, args, message, capsys):
    model = request.getfixturevalue(which)
    assert _embed(model, "hello", *args) == 2
    assert message in capsys.readouterr().err
