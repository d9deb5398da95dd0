"""Shared fixtures: tiny checkpoints written once per test session, and their references."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Servers the tests start without --state-dir keep their Batch API state in a folder of this
# run (the default is under the user's data directory, $XDG_DATA_HOME).
os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="pipepool-tests-data-")
# Servers the tests start have one front-end process unless a test asks for more: the default
# (auto) is sized to the host's cores, and a test must mean the same on any machine.
os.environ["PIPEPOOL_API_SERVER_COUNT"] = "1"
sys.path.insert(0, str(Path(__file__).parent))

import tiny_models

atexit.register(shutil.rmtree, os.environ["XDG_DATA_HOME"], ignore_errors=True)

DECODER_FAMILIES = ("qwen3", "qwen2", "llama", "mistral")

# The three pipelines an Engine can run on (docs/design.md §2): in the driver's process, as stage
# processes, as replicas. Behaviour every kind must share is tested on each through
# ``engine_kind``.
ENGINE_KINDS = {
    "in-process": {},
    "stage-processes": {"pipeline_parallel_size": 2},
    "replicas": {"data_parallel_size": 2},
}


@pytest.fixture(
    scope="module",
    # The kinds of more than one process are slow (docs/testing.md): the fast run keeps the
    # in-process kind, the full run has all three.
    params=[
        k if k == "in-process" else pytest.param(k, marks=pytest.mark.slow) for k in ENGINE_KINDS
    ],
)
def engine_kind(request) -> dict:
    """The Engine options of one pipeline kind: a module's engine fixture that takes it runs
    the module's tests once per kind."""
    return ENGINE_KINDS[request.param]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def decoder_paths(model_dir) -> dict[str, Path]:
    return {f: tiny_models.make_decoder(model_dir / f, f) for f in DECODER_FAMILIES}


@pytest.fixture(scope="session")
def qwen3_path(decoder_paths) -> Path:
    return decoder_paths["qwen3"]


@pytest.fixture(scope="session")
def bert_path(model_dir) -> Path:
    return tiny_models.make_bert(model_dir / "bert")


@pytest.fixture(scope="session")
def xlmr_path(model_dir) -> Path:
    return tiny_models.make_bert(model_dir / "xlmr", family="xlmr")


@pytest.fixture(scope="session")
def st_bert_path(model_dir) -> Path:
    return tiny_models.make_st_bert(model_dir / "st-bert")


@pytest.fixture(scope="session")
def cross_encoder_path(model_dir) -> Path:
    """ms-marco-MiniLM-L6-v2's shape (BERT cross-encoder, token types, raw-logit scores)."""
    return tiny_models.make_cross_encoder(model_dir / "ms-marco-minilm")


@pytest.fixture(scope="session")
def xlmr_reranker_path(model_dir) -> Path:
    """bge-reranker-v2-m3's shape (XLM-R cross-encoder, sigmoid scores)."""
    return tiny_models.make_xlmr_reranker(model_dir / "bge-reranker")


@pytest.fixture(scope="session")
def qwen3_reranker_path(model_dir) -> Path:
    """Qwen3-Reranker-0.6B's shape (causal LM, yes/no logits, tied LM head); the folder name
    says Reranker, as the hub id does."""
    return tiny_models.make_qwen3_reranker(model_dir / "Qwen3-Reranker-tiny")


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    return tiny_models.minilm_path()


_REFERENCES: dict[Path, tiny_models.Reference] = {}


@pytest.fixture(scope="session")
def reference():
    """reference(path) -> a cached transformers Reference for that folder."""

    def get(path: Path) -> tiny_models.Reference:
        if path not in _REFERENCES:
            _REFERENCES[path] = tiny_models.Reference(path)
        return _REFERENCES[path]

    return get
