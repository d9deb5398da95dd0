"""Issue 2 acceptance: the checkpoint layouts found in the wild load to the same model.

Each variant holds the same weights as a fixture checkpoint, written the way transformers (or
an older PyTorch workflow) writes them; every one must give the same vectors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tiny_models import MIN_COSINE, cosine, long_prompts

import pipepool

PROMPTS = long_prompts()[:6]


def _embed(path: Path) -> np.ndarray:
    with pipepool.Engine(str(path), max_num_batched_tokens=16) as engine:
        return engine.embed(PROMPTS, normalize=False)


def _assert_same_vectors(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape
    assert cosine(actual, expected).min() >= MIN_COSINE
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


def _copy_small_files(src: Path, dst: Path) -> Path:
    """Config and tokenizer files, no weights; what save_pretrained wrote is kept."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        small = f.suffix in (".json", ".txt") and "index" not in f.name
        if f.is_file() and small and not (dst / f.name).exists():
            shutil.copy(f, dst / f.name)
    return dst


@pytest.fixture(scope="module")
def qwen3_vectors(qwen3_path) -> np.ndarray:
    return _embed(qwen3_path)


@pytest.fixture(scope="module")
def bert_vectors(bert_path) -> np.ndarray:
    return _embed(bert_path)


def test_fixture_checkpoint_is_a_causal_lm_with_prefix_and_lm_head(qwen3_path):
    """The premise of the tests below: the Qwen3 fixture is a *ForCausalLM checkpoint."""
    config = json.loads((qwen3_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    names = load_file(str(qwen3_path / "model.safetensors")).keys()
    assert "lm_head.weight" in names
    assert all(n.startswith("model.") for n in names if n != "lm_head.weight")


def test_sharded_safetensors_match_single_file(tmp_path, qwen3_path, qwen3_vectors):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(qwen3_path)).save_pretrained(
        str(folder), max_shard_size="100KB"
    )
    _copy_small_files(qwen3_path, folder)
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 2 and (folder / "model.safetensors.index.json").is_file()
    assert not (folder / "model.safetensors").exists()
    _assert_same_vectors(_embed(folder), qwen3_vectors)


def test_pytorch_model_bin_fallback_matches_safetensors(tmp_path, qwen3_path, qwen3_vectors):
    folder = _copy_small_files(qwen3_path, tmp_path / "bin")
    torch.save(load_file(str(qwen3_path / "model.safetensors")), folder / "pytorch_model.bin")
    _assert_same_vectors(_embed(folder), qwen3_vectors)


def test_legacy_format_pytorch_model_bin_loads(tmp_path, qwen3_path, qwen3_vectors):
    """Checkpoints written before PyTorch 1.6 are not zip files and cannot be memory-mapped."""
    folder = _copy_small_files(qwen3_path, tmp_path / "legacy")
    tensors = load_file(str(qwen3_path / "model.safetensors"))
    torch.save(tensors, folder / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    _assert_same_vectors(_embed(folder), qwen3_vectors)


def test_unreadable_pytorch_model_bin_is_a_model_load_error(tmp_path, qwen3_path):
    folder = _copy_small_files(qwen3_path, tmp_path / "corrupt")
    (folder / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(pipepool.ModelLoadError, match=r"cannot read .*pytorch_model\.bin"):
        pipepool.Engine(str(folder))


def test_sharded_pytorch_model_bin_matches_safetensors(tmp_path, qwen3_path, qwen3_vectors):
    folder = _copy_small_files(qwen3_path, tmp_path / "bin-sharded")
    tensors = load_file(str(qwen3_path / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for k, part in enumerate((names[::2], names[1::2])):
        file = f"pytorch_model-0000{k + 1}-of-00002.bin"
        torch.save({n: tensors[n] for n in part}, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _assert_same_vectors(_embed(folder), qwen3_vectors)


def test_missing_shard_is_a_model_load_error(tmp_path, qwen3_path):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(qwen3_path)).save_pretrained(
        str(folder), max_shard_size="100KB"
    )
    _copy_small_files(qwen3_path, folder)
    victim = sorted(folder.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(pipepool.ModelLoadError, match=f"shards named in .* missing.*{victim.name}"):
        pipepool.Engine(str(folder))


def test_bare_model_checkpoint_matches_causal_lm_checkpoint(tmp_path, qwen3_path, qwen3_vectors):
    from transformers import AutoModel

    folder = tmp_path / "bare"
    AutoModel.from_pretrained(str(qwen3_path)).save_pretrained(str(folder))
    _copy_small_files(qwen3_path, folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3Model"]
    names = load_file(str(folder / "model.safetensors")).keys()
    assert "lm_head.weight" not in names and not any(n.startswith("model.") for n in names)
    _assert_same_vectors(_embed(folder), qwen3_vectors)


def test_causal_lm_checkpoint_matches_bare_model_checkpoint(tmp_path, decoder_paths, reference):
    """The other direction, on a family whose fixture is a bare ``*Model`` (Qwen2)."""
    from transformers import Qwen2ForCausalLM

    bare = decoder_paths["qwen2"]
    assert json.loads((bare / "config.json").read_text())["architectures"] == ["Qwen2Model"]
    folder = tmp_path / "causal"
    Qwen2ForCausalLM.from_pretrained(str(bare)).save_pretrained(str(folder))
    _copy_small_files(bare, folder)
    names = load_file(str(folder / "model.safetensors")).keys()
    assert "lm_head.weight" in names
    _assert_same_vectors(_embed(folder), _embed(bare))


def test_bert_masked_lm_checkpoint_with_bert_prefix(tmp_path, bert_path, bert_vectors):
    from transformers import BertForMaskedLM

    folder = tmp_path / "mlm"
    BertForMaskedLM.from_pretrained(str(bert_path)).save_pretrained(str(folder))
    _copy_small_files(bert_path, folder)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]
    names = load_file(str(folder / "model.safetensors")).keys()
    assert "bert.embeddings.word_embeddings.weight" in names
    assert any(n.startswith("cls.") for n in names)  # the MLM head, ignored
    _assert_same_vectors(_embed(folder), bert_vectors)


def test_hub_id_without_local_folder_is_a_model_load_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        pipepool.ModelLoadError,
        match=r"'pipepool-tests/no-such-model' is not a local folder and could not be fetched",
    ):
        pipepool.Engine("pipepool-tests/no-such-model")


def test_the_bundled_models_hub_id_is_its_folder_offline(monkeypatch, tmp_path, minilm_path):
    from pipepool.loading.model_folder import BUNDLED_MODEL_ID, resolve_model_path

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-cache"))
    assert resolve_model_path(BUNDLED_MODEL_ID) == resolve_model_path(None) == minilm_path
    with pipepool.Engine(BUNDLED_MODEL_ID) as by_id, pipepool.Engine() as bundled:
        texts = ["offline hub id", "the same weights"]
        assert np.array_equal(by_id.embed(texts), bundled.embed(texts))


def test_missing_local_folder_is_a_model_load_error(tmp_path):
    with pytest.raises(pipepool.ModelLoadError, match="does not exist"):
        pipepool.Engine(str(tmp_path / "nowhere"))
    (tmp_path / "file.bin").write_bytes(b"")
    with pytest.raises(pipepool.ModelLoadError, match="is a file; give the model's folder"):
        pipepool.Engine(str(tmp_path / "file.bin"))
