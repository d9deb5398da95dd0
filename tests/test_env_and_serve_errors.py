"""Issue 38 items 1, 3 and 6 (hub downloads): ``PIPEPOOL_*`` variables parsed strictly by
their flags' own parsers and named in ``--help``; ``serve`` fails on a bad model as ``embed``
does, before anything says it serves; a hub id fetches only the files a model needs and, offline,
says how to pass a local folder instead."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import pipepool
from pipepool.commands.cli import build_parser, main
from pipepool.commands.common import BOOLEAN_WORDS, env_name
from pipepool.config import EngineConfig
from pipepool.loading import model_folder

# Slow: ten real `pipepool serve` processes started to be refused.
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _no_pipepool_variables(monkeypatch):
    """Each test sets the variables it is about, and no others."""
    for name in [n for n in os.environ if n.startswith("PIPEPOOL_")]:
        monkeypatch.delenv(name)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPEPOOL_")}
    env["PYTHONPATH"] = str(Path(pipepool.__file__).parents[1])
    return {**env, **extra}


# -- PIPEPOOL_* variables -------------------------------------------------------------------

_BOOLEANS = "true, false, 1, 0, yes, no, on or off"


@pytest.mark.parametrize(
    ("command", "variable", "value", "expected"),
    [
        ("embed", "PIPEPOOL_NORMALIZE", "maybe", _BOOLEANS),
        ("embed", "PIPEPOOL_VERIFY_STATE", "ture", _BOOLEANS),
        ("embed", "PIPEPOOL_NORMALIZE", "", "set but empty: expected " + _BOOLEANS),
        ("embed", "PIPEPOOL_COMPILE", "2", _BOOLEANS),
        ("embed", "PIPEPOOL_MAX_NUM_SEQS", "many", "expected an integer"),
        ("embed", "PIPEPOOL_PP", "1.5", "expected an integer"),
        ("embed", "PIPEPOOL_SWITCH_INTERVAL_MS", "fast", "expected a number"),
        ("embed", "PIPEPOOL_DTYPE", "float64", "expected one of auto, float32, bfloat16"),
        ("embed", "PIPEPOOL_LONG_INPUTS", "cut", "expected one of truncate, error, chunk"),
        ("embed", "PIPEPOOL_PP_PARTITION", "a,b", "comma-separated layer counts"),
        ("embed", "PIPEPOOL_MODEL", " ", "set but empty"),
        ("rerank", "PIPEPOOL_RERANKER", "bge", "expected one of auto, qwen3, none"),
        ("serve", "PIPEPOOL_PORT", "80.5", "expected an integer"),
        ("serve", "PIPEPOOL_LOG_LEVEL", "loud", "expected one of critical, error, warning"),
        ("serve", "PIPEPOOL_ACCESS_LOG", "enabled", _BOOLEANS),
        ("serve", "PIPEPOOL_API_KEY", "", "set but empty"),
        ("bench", "PIPEPOOL_CUDA_GRAPHS", "sometimes", _BOOLEANS),
    ],
)
def test_bad_variable_is_an_argparse_error_naming_it_and_what_it_accepts(
    monkeypatch, capsys, command, variable, value, expected
):
    monkeypatch.setenv(variable, value)
    args = {"rerank": ["--query", "q", "d"], "embed": ["hi"]}.get(command, [])
    with pytest.raises(SystemExit) as exit:
        build_parser(command).parse_args([command, *args])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    message = err.strip().splitlines()[-1]
    assert message.startswith(f"pipepool {command}: error: argument --"), err
    shown = f"{variable} is set but empty" if not value.strip() else f"{variable}={value!r}"
    assert shown in message and expected in message, message


@pytest.mark.parametrize("word", sorted(BOOLEAN_WORDS))
def test_boolean_variable_takes_each_accepted_word_in_any_case(monkeypatch, word):
    for spelling in (word, word.upper(), f" {word.capitalize()} "):
        monkeypatch.setenv("PIPEPOOL_NORMALIZE", spelling)
        monkeypatch.setenv("PIPEPOOL_ALLOW_TOKEN_IDS", spelling)
        assert build_parser("embed").parse_args(["embed", "x"]).normalize is BOOLEAN_WORDS[word]
        args = build_parser("serve").parse_args(["serve"])
        assert args.allow_token_ids is BOOLEAN_WORDS[word]


def test_variables_are_parsed_as_their_flags_and_the_command_line_wins(monkeypatch):
    from pipepool.commands.common import engine_config

    monkeypatch.setenv("PIPEPOOL_MAX_NUM_BATCHED_TOKENS", "99")
    monkeypatch.setenv("PIPEPOOL_PP_PARTITION", "1,1")
    monkeypatch.setenv("PIPEPOOL_PP", "2")
    monkeypatch.setenv("PIPEPOOL_DTYPE", "float16")
    monkeypatch.setenv("PIPEPOOL_VERIFY_STATE", "Off")
    monkeypatch.setenv("PIPEPOOL_SWITCH_INTERVAL_MS", "0.25")
    config = engine_config(build_parser("embed").parse_args(["embed", "x", "--dtype", "float32"]))
    assert (config.max_num_batched_tokens, config.pp_partition) == (99, (1, 1))
    assert (config.pipeline_parallel_size, config.switch_interval_ms) == (2, 0.25)
    assert config.verify_state is False
    assert config.dtype == "float32"  # the flag, not the variable
    monkeypatch.setenv("PIPEPOOL_PORT", "8123")
    monkeypatch.setenv("PIPEPOOL_SHUTDOWN_TIMEOUT", "2.5")
    monkeypatch.setenv("PIPEPOOL_LOG_FORMAT", "json")
    args = build_parser("serve").parse_args(["serve"])
    assert (args.port, args.shutdown_timeout, args.log_format) == (8123, 2.5, "json")
    assert args.access_log is True and args.host == "127.0.0.1"  # unset: the flags' defaults


def test_a_bad_variable_stops_the_real_command_before_it_loads_anything():
    r = subprocess.run(
        [sys.executable, "-m", "pipepool", "embed", "hello"],
        capture_output=True,
        text=True,
        env=_clean_env(PIPEPOOL_VERIFY_STATE="ture"),
        timeout=120,
    )
    assert r.returncode == 2 and r.stdout == ""
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "pipepool embed: error: argument --verify-state/--no-verify-state: "
        f"PIPEPOOL_VERIFY_STATE='ture': expected {_BOOLEANS} (any case)"
    )


def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit) as exit:
        main([command, "--help"])
    assert exit.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", ["embed", "rerank", "ner", "serve", "bench"])
def test_help_names_the_variable_of_every_engine_flag(command, capsys):
    text = _help(command, capsys)
    for f in fields(EngineConfig):
        if f.metadata.get("cli"):
            flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
            assert re.search(rf"\[env:\s+{env_name(flag)}\]", text), (f.name, text)
    assert "PIPEPOOL_PP]" in text and "PIPEPOOL_DP]" in text  # the short flags name them


def test_help_names_the_variable_of_every_server_flag(capsys):
    text = _help("serve", capsys)
    server = text[text.index("server:") : text.index("engine:")]
    flags = re.findall(r"^  (--[a-z-]+)", server, re.M)
    assert len(flags) >= 14
    for flag in flags:
        assert re.search(rf"\[env:\s+{env_name(flag)}\]", server), flag


# -- serve: a bad model fails first, as embed does ----------------------------------------


@pytest.fixture
def no_server(monkeypatch):
    """serve must fail before it builds a server: building one fails the test at once."""
    from pipepool.server import uvicorn_server

    def build_server(*args, **kwargs):
        raise AssertionError("serve built its server for a model it cannot load")

    monkeypatch.setattr(uvicorn_server, "build_server", build_server)


def _broken_models(root: Path, bert_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (model folder or path, what the error says)."""

    def copy(name: str) -> Path:
        return Path(shutil.copytree(bert_path, root / name))

    missing = root / "nowhere"
    no_config = copy("no-config")
    (no_config / "config.json").unlink()
    no_tokenizer = copy("no-tokenizer")
    (no_tokenizer / "tokenizer.json").unlink()
    bad_tokenizer = copy("bad-tokenizer")
    (bad_tokenizer / "tokenizer.json").write_text("{}")
    unknown = copy("unknown-architecture")
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "architectures": ["FooModel"]}))
    short = copy("missing-weight")
    tensors = load_file(str(short / "model.safetensors"))
    dropped = next(name for name in sorted(tensors) if "word_embeddings" in name)
    del tensors[dropped]
    save_file(tensors, str(short / "model.safetensors"))
    return {
        "missing folder": (missing, f"model folder {str(missing)!r} does not exist"),
        "a file": (bert_path / "config.json", "is a file; give the model's folder"),
        "no config.json": (no_config, "has no config.json"),
        "no tokenizer.json": (no_tokenizer, "has no tokenizer.json"),
        "bad tokenizer.json": (bad_tokenizer, f"cannot load {bad_tokenizer / 'tokenizer.json'}"),
        "unknown architecture": (unknown, "unknown architecture 'FooModel'"),
        "missing weight": (short, f"missing weights: {dropped}"),
        "offline hub id": (Path("pipepool-tests/no-such-model"), "not in the local cache"),
    }


def test_serve_fails_on_every_bad_model_with_embeds_error_before_serving(
    bert_path, tmp_path, capsys, no_server
):
    for name, (model, message) in _broken_models(tmp_path, bert_path).items():
        assert main(["embed", "--model", str(model), "hi"]) == 2, name
        embed_err = capsys.readouterr().err
        assert main(["serve", "--model", str(model), "--port", "0"]) == 2, name
        out, err = capsys.readouterr()
        assert out == "" and err.startswith("pipepool serve: error: "), (name, err)
        assert len(err.strip().splitlines()) == 1, f"{name}: a message, not a traceback: {err}"
        assert message in err, (name, err)
        assert err.removeprefix("pipepool serve") == embed_err.removeprefix("pipepool embed")


def test_serve_with_a_missing_folder_says_so_and_never_starts(tmp_path):
    """The issue's case as a user meets it: the real command, its whole output."""
    missing = tmp_path / "no-such-model"
    r = subprocess.run(
        [sys.executable, "-m", "pipepool", "serve", "--model", str(missing), "--port", "0"],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"pipepool serve: error: model folder {str(missing)!r} does not exist"
    ]


# -- hub ids: the files a model needs, and an offline hint ----------------------------------

# A sentence-transformers repository as the hub holds it (all-MiniLM-L6-v2's kind): the same
# weights in several formats, exports for other runtimes, training files.
_ST_REPO = [
    ".gitattributes", "README.md", "config.json", "config_sentence_transformers.json",
    "data_config.json", "model.safetensors", "pytorch_model.bin", "tf_model.h5",
    "rust_model.ot", "modules.json", "sentence_bert_config.json", "special_tokens_map.json",
    "tokenizer.json", "tokenizer_config.json", "vocab.txt", "train_script.py",
    "1_Pooling/config.json", "onnx/model.onnx", "onnx/model_qint8_avx512.onnx",
    "openvino/openvino_model.bin", "openvino/openvino_model.xml",
]  # fmt: skip
_ST_NEEDED = {
    "config.json", "config_sentence_transformers.json", "model.safetensors", "modules.json",
    "sentence_bert_config.json", "special_tokens_map.json", "tokenizer.json",
    "tokenizer_config.json", "1_Pooling/config.json",
}  # fmt: skip
# A sharded decoder with pickled weights only, and a Dense module.
_BIN_REPO = [
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "pytorch_model.bin.index.json", "pytorch_model-00001-of-00002.bin",
    "pytorch_model-00002-of-00002.bin", "modules.json", "2_Dense/config.json",
    "2_Dense/pytorch_model.bin", "flax_model.msgpack",
]  # fmt: skip
_BIN_NEEDED = set(_BIN_REPO) - {"generation_config.json", "flax_model.msgpack"}


class FakeHub:
    """``snapshot_download`` over one repository's file list: writes the files that
    ``allow_patterns`` select (filtered as huggingface_hub filters them) into one snapshot
    folder; nothing is cached until something was fetched."""

    def __init__(self, root: Path, files: list[str]) -> None:
        self.snapshot = root / "snapshot"
        self.files = files
        self.fetched: list[set[str]] = []

    def __call__(self, repo_id, *, local_files_only=False, allow_patterns=None, **kwargs):
        from huggingface_hub.utils import LocalEntryNotFoundError, filter_repo_objects

        assert not kwargs, kwargs
        if local_files_only:
            if not self.snapshot.exists():
                raise LocalEntryNotFoundError("not in the cache")
            return str(self.snapshot)
        chosen = set(filter_repo_objects(self.files, allow_patterns=allow_patterns))
        self.fetched.append(chosen)
        for name in chosen:
            (self.snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            (self.snapshot / name).write_text("{}")
        return str(self.snapshot)

    def held(self) -> set[str]:
        return {p.relative_to(self.snapshot).as_posix() for p in self.snapshot.rglob("*.*")}


@pytest.mark.parametrize(
    ("files", "needed", "fetches"),
    [(_ST_REPO, _ST_NEEDED, 1), (_BIN_REPO, _BIN_NEEDED, 2)],
    ids=["sentence-transformers with safetensors", "pickled shards only"],
)
def test_hub_id_fetches_only_the_files_a_model_needs(monkeypatch, tmp_path, files, needed, fetches):
    import huggingface_hub

    hub = FakeHub(tmp_path, files)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    assert model_folder.resolve_model_path("org/model") == hub.snapshot
    assert hub.held() == needed
    assert len(hub.fetched) == fetches
    # Now cached whole: the next start reads the cache and fetches nothing.
    assert model_folder.resolve_model_path("org/model") == hub.snapshot
    assert len(hub.fetched) == fetches


@pytest.mark.parametrize(
    ("offline", "reason"),
    [(True, "HF_HUB_OFFLINE is set"), (False, "the hub cannot be reached (connection refused)")],
)
def test_hub_id_not_in_the_cache_offline_says_to_pass_a_local_folder(monkeypatch, offline, reason):
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils import LocalEntryNotFoundError

    def unreachable(repo_id, **kwargs):
        raise LocalEntryNotFoundError("connection refused\nmore detail")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    with pytest.raises(pipepool.ModelLoadError) as error:
        model_folder.resolve_model_path("org/model")
    message = str(error.value)
    assert message.startswith("'org/model' is not a local folder and could not be fetched")
    assert f"it is not in the local cache ({constants.HF_HUB_CACHE}) and {reason}" in message
    assert "pass the model's local folder instead (--model DIR;" in message
    assert "hf download org/model --local-dir DIR" in message
