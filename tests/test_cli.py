"""Issue 2 acceptance: ``pipepool embed`` gives what ``Engine.embed`` gives, in every input and
output format, and a bad input is exit status 2 with a message on stderr."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tiny_models import SENTENCES

import pipepool
from pipepool.commands.cli import main
from pipepool.config import EngineConfig

TEXTS = SENTENCES[:5]


@pytest.fixture(scope="module")
def expected(bert_path) -> np.ndarray:
    with pipepool.Engine(str(bert_path)) as engine:
        return engine.embed(TEXTS)


@pytest.fixture(scope="module")
def expected_ids(bert_path) -> tuple[list[list[int]], np.ndarray]:
    with pipepool.Engine(str(bert_path)) as engine:
        ids = [x.tolist() for x in engine.tokenize(TEXTS[:2])]
        return ids, engine.embed(ids)


def _embed(bert_path, *args: str) -> int:
    return main(["embed", "--model", str(bert_path), "--no-progress", *args])


def _assert_equal_vectors(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-7)


def _read_jsonl(path: Path) -> np.ndarray:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(len(rows)))
    return np.array([r["embedding"] for r in rows], dtype=np.float32)


def test_text_arguments_print_one_line_per_vector(bert_path, expected, capsys):
    assert _embed(bert_path, *TEXTS) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == len(TEXTS)
    for i, (line, vector) in enumerate(zip(lines, expected, strict=True)):
        assert line.startswith(f"[{i}] dim=64 [")
        head = ", ".join(f"{x:+.4f}" for x in vector[:6])
        assert head in line
    assert f"embedded {len(TEXTS)} inputs" in err


def test_txt_input_to_npy_output(bert_path, expected, tmp_path, capsys):
    source = tmp_path / "in.txt"
    source.write_text("\n".join([TEXTS[0], "", *TEXTS[1:], ""]) + "\n")  # blank lines skipped
    target = tmp_path / "out.npy"
    assert _embed(bert_path, "--input", str(source), "--output", str(target)) == 0
    _assert_equal_vectors(np.load(target), expected)
    assert capsys.readouterr().out == ""  # vectors went to the file


def test_jsonl_input_to_jsonl_output(bert_path, expected, tmp_path):
    source = tmp_path / "in.jsonl"
    lines = [json.dumps(TEXTS[0]), json.dumps({"text": TEXTS[1]}), json.dumps({"input": TEXTS[2]})]
    lines += ["", *(json.dumps(t) for t in TEXTS[3:])]
    source.write_text("\n".join(lines) + "\n")
    target = tmp_path / "out.jsonl"
    assert _embed(bert_path, "--input", str(source), "--output", str(target)) == 0
    _assert_equal_vectors(_read_jsonl(target), expected)


def test_jsonl_token_id_lists(bert_path, expected_ids, tmp_path):
    ids, vectors = expected_ids
    source = tmp_path / "ids.jsonl"
    source.write_text("\n".join(json.dumps(x) for x in ids) + "\n")
    target = tmp_path / "out.npy"
    assert _embed(bert_path, "--input", str(source), "--output", str(target)) == 0
    _assert_equal_vectors(np.load(target), vectors)


def test_text_arguments_and_input_file_together(bert_path, expected, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("\n".join(TEXTS[2:]))
    target = tmp_path / "out.npy"
    assert _embed(bert_path, *TEXTS[:2], "--input", str(source), "--output", str(target)) == 0
    _assert_equal_vectors(np.load(target), expected)


def test_dimensions_and_prompt_name_reach_the_engine(st_bert_path, tmp_path):
    target = tmp_path / "out.npy"
    options = ["--model", str(st_bert_path), "--dimensions", "8", "--prompt-name", "query"]
    assert main(["embed", *options, "--output", str(target), *TEXTS]) == 0
    with pipepool.Engine(str(st_bert_path)) as engine:
        want = engine.embed(TEXTS, dimensions=8, prompt_name="query")
    _assert_equal_vectors(np.load(target), want)


@pytest.mark.parametrize(
    ("make_args", "message"),
    [
        (lambda d: ["--dimensions", "999", "hi"], "dimensions=999 is larger"),
        (lambda d: [], "nothing to embed"),
        (lambda d: [""], "input 0 is an empty string"),
        (lambda d: ["--input", str(d / "missing.txt")], "cannot read --input"),
        (lambda d: ["--input", str(d / "bad.jsonl")], r"bad.jsonl:2: not valid JSON"),
        (lambda d: ["--input", str(d / "number.jsonl")], r"number.jsonl:1: expected a string"),
        (
            lambda d: ["--input", str(d / "mixed.jsonl")],
            "mixed.jsonl:2: input 1 is a token list but input 0 is a string",
        ),
        (lambda d: ["--output", str(d / "out.csv"), "hi"], "--output must end in .npy or .jsonl"),
        (lambda d: ["--output", str(d / "no" / "out.npy"), "hi"], "does not exist"),
        (lambda d: ["--prompt-name", "query", "hi"], "unknown prompt_name 'query'"),
        (
            lambda d: [
                "--long-inputs",
                "error",
                "--max-model-len",
                "4",
                "a",
                "much longer sentence",
            ],
            r"TEXT argument 2: input 1 has 5 tokens, more than max_model_len=4.*--long-inputs",
        ),
    ],
)
def test_bad_input_exits_2_with_message_on_stderr(bert_path, tmp_path, capsys, make_args, message):
    (tmp_path / "bad.jsonl").write_text('"fine"\n{not json\n')
    (tmp_path / "number.jsonl").write_text("3\n")
    (tmp_path / "mixed.jsonl").write_text('"text"\n[101, 102]\n')
    assert _embed(bert_path, *make_args(tmp_path)) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("pipepool embed: error: ")
    assert len(err.strip().splitlines()) == 1, "a message, not a traceback"
    assert re.search(message, err), err
    assert not (tmp_path / "out.csv").exists()


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["embed", "--mdoel", "x", "hi"], "--mdoel: did you mean --model"),
        (["serve", "--max-num-batch-tokens", "5"], "did you mean --max-num-batched-tokens"),
        (["embd", "hi"], "did you mean embed?"),
    ],
)
def test_a_misspelled_flag_or_command_gets_the_closest_names(argv, hint, capsys):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    assert hint in capsys.readouterr().err


def test_bad_model_exits_2(tmp_path, capsys):
    assert main(["embed", "--model", str(tmp_path / "nowhere"), "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err


# The README's quick start installs the bundled model without its dependencies: it must not
# need them (nor torch._dynamo or sympy, whose imports cost seconds of every start).
_LEAN = (
    "import sys\n"
    "for name in ('transformers', 'sentence_transformers', 'scipy', 'sklearn'):\n"
    "    sys.modules[name] = None  # importing it now raises ImportError\n"
    "from pipepool.commands.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "for slow in ('torch._dynamo', 'sympy'):  # seconds of start-up, needed by neither\n"
    "    assert slow not in sys.modules, f'{slow} was imported'\n"
    "sys.exit(code)\n"
)


def test_readme_command_runs_end_to_end_with_the_default_model(tmp_path, minilm_path):
    from sentence_transformers import SentenceTransformer

    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPEPOOL_")}
    env["PYTHONPATH"] = str(Path(pipepool.__file__).parents[1])
    texts = ["The quick brown fox", "jumps over the lazy dog"]
    proc = subprocess.run(
        [sys.executable, "-c", _LEAN, "embed", *texts],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "384-dim vectors with sentence-transformers/all-MiniLM-L6-v2 [" in proc.stderr
    want = SentenceTransformer(str(minilm_path), device="cpu").encode(texts)
    heads = [", ".join(f"{x:+.4f}" for x in v[:6]) for v in want]
    assert proc.stdout == "".join(f"[{i}] dim=384 [{h}, ...]\n" for i, h in enumerate(heads))


def test_json_array_input_and_jsonl_output_with_the_text(bert_path, expected, tmp_path):
    source = tmp_path / "in.json"
    source.write_text(json.dumps([TEXTS[0], {"text": TEXTS[1]}, *TEXTS[2:]], indent=2))
    target = tmp_path / "out.jsonl"
    assert _embed(bert_path, "--input", str(source), "--output", str(target)) == 0
    _assert_equal_vectors(_read_jsonl(target), expected)
    rows = [json.loads(line) for line in target.read_text().splitlines()]
    assert [r["text"] for r in rows] == TEXTS
    assert _embed(bert_path, "--input", str(source), "--output", str(target), "--no-text") == 0
    assert "text" not in json.loads(target.read_text().splitlines()[0])


def test_stdin_dash_reads_one_text_per_line(bert_path, expected, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join([TEXTS[0], "", *TEXTS[1:]]) + "\n"))
    target = tmp_path / "out.npy"
    assert _embed(bert_path, "--input", "-", "--output", str(target)) == 0
    _assert_equal_vectors(np.load(target), expected)
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(TEXTS[2:])))
    assert _embed(bert_path, *TEXTS[:2], "-", "--output", str(target)) == 0
    _assert_equal_vectors(np.load(target), expected)


@pytest.mark.parametrize(
    ("content", "name", "message"),
    [
        ("", "empty.txt", r"empty.txt has nothing to embed \(it is empty or has only blank"),
        ("\n  \n", "blank.txt", "blank.txt has nothing to embed"),
        ("[]", "empty.json", "empty.json has nothing to embed"),
        ('{"a": 1}', "object.json", "object.json: expected a JSON array"),
        ('["ok", 3]', "bad.json", "bad.json element 1: expected a string"),
        ('["ok", ""]', "blank.json", "blank.json element 1: input 1 is an empty string"),
        ("ok\n\n" + "word " * 600, "long.txt", "long.txt:3: input 1 has 602 tokens"),
    ],
)
def test_input_file_errors_name_the_file_and_line(
    bert_path, tmp_path, capsys, content, name, message
):
    (tmp_path / name).write_text(content)
    args = ["--long-inputs", "error", "--input", str(tmp_path / name)]
    assert _embed(bert_path, *args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err


def test_no_input_at_all_says_how_to_give_some(capsys):
    assert main(["embed"]) == 2
    assert "give TEXT arguments, --input FILE, or '-' to read stdin" in capsys.readouterr().err


def test_progress_bar_moves_as_requests_finish(bert_path, monkeypatch):
    import tqdm

    from pipepool.api.progress import follow

    seen = []
    original = tqdm.tqdm.update

    def update(self, n=1):
        seen.append(self.n + n)
        return original(self, n)

    monkeypatch.setattr(tqdm.tqdm, "update", update)
    texts = [f"{i} {SENTENCES[i % len(SENTENCES)]}" for i in range(100)]
    with pipepool.Engine(str(bert_path), max_num_batched_tokens=64) as engine:
        follow(engine.submit(texts), disable=False)
        steps = engine.stats.steps
    assert steps > 10
    moves = sorted(set(seen) - {0})
    assert moves[-1] == len(texts) and len(moves) > 10  # many moves, not one at the end


# -- issue 38: bench honours --requests everywhere and reports progress; help and README say
# what the code does ------------------------------------------------------------------------


def test_text_workload_first_n_texts_are_the_whole_workloads_first():
    from pipepool.commands.workloads import TEXT_WORKLOADS, make_texts

    words = ["alpha", "beta", "gamma", "delta", "epsilon"]
    for name, (count, _, _) in TEXT_WORKLOADS.items():
        whole = make_texts(name, words)
        assert len(whole) == count
        assert make_texts(name, words, requests=7) == whole[:7]


def test_bench_requests_limits_every_workload_and_progress_goes_to_stderr(
    bert_path, st_bert_path, tmp_path, capsys
):
    runs = [("T5", st_bert_path, "texts"), ("W1", bert_path, "tokens")]
    for workload, model, unit in runs:
        rows_file = tmp_path / f"{workload}.json"
        args = ["--model", str(model), "--workload", workload, "--requests", "7"]
        args += ["--passes", "2", "--warm-up-passes", "1", "--st-batch-sizes", "4"]
        args += ["--peer-batch-sizes", "4", "--json", str(rows_file)]
        assert main(["bench", *args]) == 0
        out, err = capsys.readouterr()
        rows = json.loads(rows_file.read_text())
        assert [(r["workload"], r["requests"]) for r in rows] == [(workload, 7)]
        assert "bench " not in out and "pass 1" not in out  # stdout: the table only
        mine = [line for line in err.splitlines() if line.startswith(f"bench {workload}: ")]
        phases = [line.split(": ", 1)[1] for line in mine]
        expected = [
            "starting the engine",
            "engine started in",
            "warm-up: up to 1 passes",
            "warm-up pass 1: ",
            "timed: 2 passes",
            "timed pass 1: ",
            "timed pass 2: ",
            "peer: ",
            "peer batch size 4: ",
        ]
        found = iter(phases)  # each phase in this order, other lines between them
        for start in expected:
            assert any(p.startswith(start) for p in found), (workload, start, mine)
        assert any(re.search(rf"timed pass 1: [\d.]+ s \([\d,]+ {unit}/s\)", p) for p in phases)


def test_bench_runs_a_sequence_classifier_against_transformers_on_the_same_requests(
    tmp_path, capsys
):
    """A reranker's W1: its raw scores against AutoModelForSequenceClassification's logits,
    prompts chunked (budget 64 under W1's longest requests), fp32. Without soft-capping:
    the peer's SDPA attention does not apply it."""
    from tiny_gemma import make_gemma2

    model = make_gemma2(tmp_path / "gemma2-reranker", num_labels=1, softcap=None)
    rows_file = tmp_path / "rows.json"
    args = ["--model", str(model), "--workload", "W1", "--requests", "6", "--passes", "1"]
    args += ["--warm-up-passes", "1", "--peer-batch-sizes", "4", "--json", str(rows_file)]
    assert main(["bench", *args, "--max-num-batched-tokens", "64"]) == 0
    capsys.readouterr()
    (row,) = json.loads(rows_file.read_text())
    assert row["requests"] == 6 and row["tokens"] > 6 * 64  # so one prompt, at least, chunks
    assert row["engine_tokens_per_s"] > 0 and row["peer_tokens_per_s"] > 0
    assert "min_cosine_engine_vs_peer" not in row
    assert row["max_score_diff_engine_vs_peer"] <= 1e-4, row


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workload", "T9"], "argument --workload: unknown workload 'T9' (known: W1, W2, W3"),
        (["--requests", "0"], "argument --requests: expected an integer >= 1, got '0'"),
        (["--passes", "two"], "argument --passes: expected an integer >= 1, got 'two'"),
        (
            ["--st-batch-sizes", "32,x"],
            "argument --st-batch-sizes: expected comma-separated batch sizes (integers >= 1), "
            "got '32,x'",
        ),
    ],
)
def test_bench_bad_arguments_are_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["bench", *args])
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def test_step_budget_help_states_the_defaults_the_deployment_uses(capsys):
    from pipepool.loading.deployment import step_tokens

    with pytest.raises(SystemExit):
        main(["embed", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # unwrapped
    start = text.index("--max-num-batched-tokens MAX_NUM_BATCHED_TOKENS token budget")
    budget_help = text[start : text.index("--max-num-seqs", start)]
    config = EngineConfig()
    cpu = step_tokens(config, False, 1e6)
    largest = step_tokens(config, True, 1.0)  # a tiny model: the most tokens a step takes
    smallest = step_tokens(config, True, 1e15)  # a huge one: the fewest
    assert f"default: chosen per device and model: {cpu} on the CPU" in budget_help
    assert f"at least {smallest} tokens and at most {largest}" in budget_help
    assert step_tokens(config.replace(max_num_batched_tokens=77), True, 1.0) == 77


_REPO = Path(__file__).parents[1]


_DOCS = [_REPO / "README.md", _REPO / "BENCHMARKS.md", *sorted((_REPO / "docs").glob("**/*.md"))]


@pytest.mark.parametrize("page", _DOCS, ids=lambda p: p.relative_to(_REPO).as_posix())
def test_docs_cite_only_files_in_the_repository(page):
    text = page.read_text()
    assert not re.search(r"\bDESIGN\b", text), "the design page is docs/design.md"
    held = [
        p.relative_to(_REPO).as_posix()
        for p in _REPO.rglob("*")
        if p.is_file() and not ({".git", ".venv", ".gpu"} & set(p.relative_to(_REPO).parts))
    ]
    cited = set(re.findall(r"[\w./-]*\w\.(?:md|py|sh)\b", text)) | {".ci/run", "LICENSE"}
    for name in cited:
        if name.startswith(("./", "../")):  # a link relative to the page
            assert (page.parent / name).resolve().is_file(), f"{page.name} links to {name}"
            continue
        assert any(h == name or h.endswith("/" + name) for h in held), f"{page.name} cites {name}"


def test_readme_stays_a_ten_minute_read():
    assert len((_REPO / "README.md").read_text().splitlines()) <= 250


def test_license_is_the_apache_2_text_pyproject_names():
    text = (_REPO / "LICENSE").read_text()
    assert 'license = "Apache-2.0"' in (_REPO / "pyproject.toml").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 190


def test_docs_list_the_environment_variables_and_readme_says_why_torch_is_pinned():
    cli = " ".join((_REPO / "docs" / "cli.md").read_text().split())
    assert "## Environment variables" in cli
    for variable in ("PIPEPOOL_MAX_NUM_BATCHED_TOKENS", "PIPEPOOL_PP", "PIPEPOOL_API_KEY"):
        assert f"`{variable}`" in cli
    assert '`PIPEPOOL_NORMALIZE=maybe` is not read as "off"' in cli
    readme = " ".join((_REPO / "README.md").read_text().split())
    pin = readme[readme.index("`torch==2.13.0` is the torch") :][:700]
    assert "CPU build" in pin and "on local disk" in pin
    assert "GPU machine install torch 2.13.0's CUDA build" in pin and "pytorch.org" in pin
