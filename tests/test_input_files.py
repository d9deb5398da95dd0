"""Issue 38 item 2: input files are read line for line. Only ``\\n`` and ``\\r\\n`` end a line;
blank lines are left out (counted, with a row->line map next to the output) or embedded like
sentence-transformers embeds them (``--keep-blank``); a line that is not valid UTF-8 stops the
run, is left out or is read with U+FFFD (``--errors``), named by its line number."""

from __future__ import annotations

import io
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from tiny_models import SENTENCES

import pipepool
from pipepool.commands.cli import main
from pipepool.commands.embed import line_map_path
from pipepool.intake.text_files import UndecodableLineError, read_inputs, split_lines

# Every character ``str.splitlines()`` ends a line at, except "\n" and "\r\n": none of them
# may end one here. A lone "\r" stays inside its line too.
NOT_TERMINATORS = ["\x0c", "\v", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\r"]
# Whitespace-only lines, blank as much as an empty one (str.strip() removes all of these).
BLANKS = ["", "  \t", "\x0c", "\u2028", "\x85", "\v", "\u2029 \x1c"]
BAD_BYTES = b"caf\xe9 au lait"  # Latin-1's é: not valid UTF-8
MIN_COSINE = 0.99999


@dataclass(frozen=True)
class Made:
    """A file written line by line, and what each of its lines is, known by construction."""

    data: bytes
    texts: list[str]  # line i + 1 as decoded text ("\ufffd" for the invalid byte)
    blank: list[bool]  # whether line i + 1 is blank
    bad: int  # 1-based number of the line that is not valid UTF-8

    def numbers(self, *, errors: str, keep_blank: bool = False) -> list[int]:
        """The 1-based lines that become rows under ``errors`` (not "stop")."""
        return [
            n
            for n in range(1, len(self.texts) + 1)
            if (keep_blank or not self.blank[n - 1]) and not (errors == "skip" and n == self.bad)
        ]


def make_lines(count: int, bad: int) -> Made:
    """``count`` lines: sentences with a character that ``str.splitlines()`` would split at in
    their middle, blank lines of every kind, ``\\n`` and ``\\r\\n`` endings, and line ``bad``
    with an invalid byte. The last line has no terminator."""
    raws, texts, blank = [], [], []
    for i in range(count):
        n = i + 1
        if n == bad:
            raws.append(BAD_BYTES)
            texts.append(BAD_BYTES.decode("utf-8", errors="replace"))
            blank.append(False)
            continue
        if i % 20 == 7 or i % 97 == 3:
            text = BLANKS[i % len(BLANKS)]
        else:
            sep = NOT_TERMINATORS[i % len(NOT_TERMINATORS)]
            text = f"{SENTENCES[i % len(SENTENCES)]}{sep}line {n}"
        raws.append(text.encode("utf-8"))
        texts.append(text)
        blank.append(not text.strip())
    endings = [b"\r\n" if i % 3 == 0 else b"\n" for i in range(count - 1)] + [b""]
    data = b"".join(raw + end for raw, end in zip(raws, endings, strict=True))
    return Made(data, texts, blank, bad)


BIG = make_lines(5000, bad=2345)
SMALL = make_lines(48, bad=17)


def test_big_file_has_what_the_issue_tripped_on():
    text = BIG.data.decode("utf-8", errors="replace")
    assert len(text.splitlines()) > 5000  # what str.splitlines() made of it
    assert sum(BIG.blank) > 200 and all(c in text for c in NOT_TERMINATORS)


@pytest.mark.parametrize(
    ("data", "lines"),
    [
        (b"", []),
        (b"\n", [""]),
        (b"a", ["a"]),
        (b"a\n", ["a"]),
        (b"a\n\n", ["a", ""]),
        (b"a\r\nb\r\n", ["a", "b"]),
        (b"a\rb\n", ["a\rb"]),
        (b"a\r\r\nb", ["a\r", "b"]),
        (b"\xef\xbb\xbfa\nb", ["a", "b"]),  # a byte order mark is not text
        *((f"a{c}b\nc".encode(), [f"a{c}b", "c"]) for c in NOT_TERMINATORS),
    ],
)
def test_only_newline_and_crlf_end_a_line(data, lines):
    assert split_lines(data, name="f") == split_lines(data, name="f", errors="skip")
    assert split_lines(data, name="f").texts == lines
    assert split_lines(data, name="f").numbers == list(range(1, len(lines) + 1))


def test_split_5000_lines_gives_one_entry_per_line_under_each_errors_mode():
    with pytest.raises(UndecodableLineError, match=r"^f.txt:2345: not valid UTF-8 \(byte 0xe9 at"):
        split_lines(BIG.data, name="f.txt")
    skipped = split_lines(BIG.data, name="f.txt", errors="skip")
    assert skipped.undecodable == [BIG.bad] and skipped.replaced == []
    assert skipped.numbers == BIG.numbers(errors="skip", keep_blank=True)
    assert skipped.texts == [BIG.texts[n - 1] for n in skipped.numbers]
    replaced = split_lines(BIG.data, name="f.txt", errors="replace")
    assert replaced.texts == BIG.texts and replaced.numbers == list(range(1, 5001))
    assert replaced.replaced == [BIG.bad] and "\ufffd" in replaced.texts[BIG.bad - 1]
    valid = split_lines(BIG.data.replace(BAD_BYTES, b"cafe"), name="f.txt")  # one decode
    assert valid.numbers == list(range(1, 5001))
    assert valid.texts == [t if n != BIG.bad else "cafe" for n, t in enumerate(BIG.texts, 1)]


@pytest.mark.parametrize("errors", ["skip", "replace"])
@pytest.mark.parametrize("keep_blank", [False, True])
def test_read_5000_line_file_rows_and_line_map(tmp_path, errors, keep_blank):
    path = tmp_path / "big.txt"
    path.write_bytes(BIG.data)
    inputs = read_inputs([], path, keep_blank=keep_blank, errors=errors)
    numbers = BIG.numbers(errors=errors, keep_blank=keep_blank)
    assert inputs.line_map() == numbers
    assert inputs.items == [BIG.texts[n - 1] for n in numbers]
    assert inputs.origins[:2] == [f"{path}:{n}" for n in numbers[:2]]
    assert inputs.skipped_blank == (0 if keep_blank else sum(BIG.blank))
    assert inputs.undecodable == ([f"{path}:{BIG.bad}"] if errors == "skip" else [])
    assert inputs.replaced == ([f"{path}:{BIG.bad}"] if errors == "replace" else [])
    expected_rows = 5000 - (errors == "skip") - (0 if keep_blank else sum(BIG.blank))
    assert len(inputs.items) == expected_rows


# -- end to end: `pipepool embed` ---------------------------------------------------------------


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    assert a.shape == b.shape
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def _embed(model: Path, *args: str) -> int:
    return main(["embed", "--model", str(model), "--no-progress", *args])


@pytest.mark.parametrize(("errors", "keep_blank"), [("skip", False), ("replace", True)])
def test_embed_5000_line_file_rows_are_its_lines_with_a_line_map(
    bert_path, tmp_path, capsys, errors, keep_blank
):
    source, target = tmp_path / "in.txt", tmp_path / "out.npy"
    source.write_bytes(BIG.data)
    args = ["--input", str(source), "--output", str(target), "--errors", errors]
    assert _embed(bert_path, *args, *(["--keep-blank"] if keep_blank else [])) == 0
    err = capsys.readouterr().err
    vectors = np.load(target)
    numbers = BIG.numbers(errors=errors, keep_blank=keep_blank)
    assert len(vectors) == len(numbers) == (5000 if keep_blank else 5000 - sum(BIG.blank) - 1)
    map_path = line_map_path(target)
    assert map_path == tmp_path / "out.npy.lines.txt"
    assert map_path.read_text() == "".join(f"{n}\n" for n in numbers)
    assert np.loadtxt(map_path, dtype=int).tolist() == numbers
    # Rows against the same lines embedded directly; the engine refuses "", whose rows must
    # equal those of whitespace-only lines: BERT tokenises both to [CLS] [SEP].
    lines = [BIG.texts[n - 1] for n in numbers]
    rows = [i for i, line in enumerate(lines) if line]
    with pipepool.Engine(str(bert_path)) as engine:
        want = engine.embed([lines[i] for i in rows])
    assert _cosines(vectors[rows], want).min() >= MIN_COSINE
    empty = [i for i, line in enumerate(lines) if not line]
    assert bool(empty) == keep_blank
    if keep_blank:
        spaces = lines.index("  \t")
        assert _cosines(vectors[empty], vectors[[spaces] * len(empty)]).min() >= MIN_COSINE
    else:
        assert f"skipped {sum(BIG.blank)} blank lines" in err
        assert f"row->line map written to {map_path}" in err
    if errors == "skip":
        assert f"skipped 1 lines that are not valid UTF-8: {source}:{BIG.bad}" in err
    else:
        assert f"replaced invalid UTF-8 with U+FFFD in 1 lines: {source}:{BIG.bad}" in err


def test_undecodable_line_stops_by_default_naming_its_line(bert_path, tmp_path, capsys):
    source = tmp_path / "in.txt"
    source.write_bytes(SMALL.data)
    for args in ([], ["--errors", "stop"]):
        assert _embed(bert_path, "--input", str(source), *args) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1, err
        assert re.search(
            rf"in.txt:{SMALL.bad}: not valid UTF-8 \(byte 0xe9 at character 4\); --errors skip "
            r"leaves such lines out, --errors replace",
            err,
        ), err


@pytest.mark.parametrize("prompt", [[], ["--prompt-name", "query"]])
def test_keep_blank_embeds_every_line_as_sentence_transformers_does(st_bert_path, tmp_path, prompt):
    from sentence_transformers import SentenceTransformer

    source, target = tmp_path / "in.txt", tmp_path / "out.npy"
    source.write_bytes(SMALL.data)
    args = ["--input", str(source), "--output", str(target), "--errors", "replace"]
    assert _embed(st_bert_path, *args, "--keep-blank", *prompt) == 0
    vectors = np.load(target)
    assert len(vectors) == len(SMALL.texts)  # one row per line, blank ones included
    assert line_map_path(target).read_text().split() == [str(n) for n in range(1, 49)]
    st = SentenceTransformer(str(st_bert_path), device="cpu")
    want = st.encode(SMALL.texts, prompt_name=prompt[1] if prompt else None)
    assert _cosines(vectors, want).min() >= MIN_COSINE
    assert "" in SMALL.texts  # embedded as ST embeds "", not refused


def test_keep_blank_file_of_blank_lines_only(st_bert_path, tmp_path):
    from sentence_transformers import SentenceTransformer

    source, target = tmp_path / "blank.txt", tmp_path / "out.npy"
    source.write_text("\n\n \n")
    assert (
        _embed(st_bert_path, "--input", str(source), "--output", str(target), "--keep-blank") == 0
    )
    want = SentenceTransformer(str(st_bert_path), device="cpu").encode(["", "", " "])
    assert _cosines(np.load(target), want).min() >= MIN_COSINE


def test_keep_blank_also_embeds_empty_texts_of_jsonl_and_arguments(bert_path, tmp_path):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text('"one"\n\n{"text": ""}\n"two"\n')
    assert (
        _embed(bert_path, "", "--input", str(source), "--output", str(target), "--keep-blank") == 0
    )
    rows = [json.loads(line) for line in target.read_text().splitlines()]
    assert [r["text"] for r in rows] == ["", "one", "", "", "two"]
    vectors = np.array([r["embedding"] for r in rows])
    assert np.allclose(vectors[0], vectors[2]) and np.allclose(vectors[0], vectors[3])
    assert not line_map_path(target).exists()  # a TEXT argument row has no line


def test_jsonl_errors_name_the_line_after_form_feeds_and_blank_lines(bert_path, tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    lines = ['"a\\fb"', "", '"c\u2028d\x85e"', '{"text": ""}', "{broken"]
    source.write_text("\n".join(lines) + "\n")
    assert _embed(bert_path, "--input", str(source)) == 2
    assert f"{source}:5: not valid JSON" in capsys.readouterr().err
    source.write_text("\n".join(lines[:4]) + "\n")
    assert _embed(bert_path, "--input", str(source)) == 2
    assert f"{source}:4: input 2 is an empty string" in capsys.readouterr().err


def test_engine_errors_name_the_line_after_separators(bert_path, tmp_path, capsys):
    source = tmp_path / "in.txt"
    source.write_text("a\x0cb\u2028c\n\nd\x85e\n" + "word " * 600 + "\n")
    assert _embed(bert_path, "--long-inputs", "error", "--input", str(source)) == 2
    err = capsys.readouterr().err
    assert f"{source}:4: input 2 has 602 tokens" in err, err


def test_stdin_is_read_as_bytes_line_for_line(bert_path, tmp_path, monkeypatch, capsys):
    data = b"one\x0ctwo\n\nthree\nbad \xff\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    target = tmp_path / "out.npy"
    assert _embed(bert_path, "-", "--output", str(target), "--errors", "skip") == 0
    assert len(np.load(target)) == 2
    assert line_map_path(target).read_text() == "1\n3\n"
    assert "skipped 1 lines that are not valid UTF-8: <stdin>:4" in capsys.readouterr().err


def test_json_array_with_an_invalid_byte_names_its_line(tmp_path):
    path = tmp_path / "in.json"
    path.write_bytes(b'[\n  "ok",\n  "caf\xe9"\n]')
    with pytest.raises(UndecodableLineError, match=r"in.json:3: not valid UTF-8"):
        read_inputs([], path)
    with pytest.raises(UndecodableLineError, match=r"in.json:3: .*\.txt and \.jsonl files only"):
        read_inputs([], path, errors="skip")
    assert read_inputs([], path, errors="replace").items == ["ok", "caf\ufffd"]
