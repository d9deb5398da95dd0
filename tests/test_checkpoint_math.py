"""The math a checkpoint asks for is the math that runs: a decoder whose config says
``is_causal: false`` attends bidirectionally at every PP degree; remote code named by
``auto_map``, config fields no family implements and non-sentence-transformers modules are
refused by name (issue 31)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import MIN_COSINE, Reference, cosine, long_prompts, make_decoder

import pipepool

BIDIRECTIONAL_FAMILIES = ("qwen2", "qwen3")


@pytest.fixture(scope="module")
def bidirectional_paths(model_dir) -> dict[str, Path]:
    """gte-Qwen2-instruct's kind of checkpoint: a decoder with ``is_causal: false``."""
    return {
        f: make_decoder(model_dir / f"{f}-bidirectional", f, is_causal=False)
        for f in BIDIRECTIONAL_FAMILIES
    }


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _assert_matches(engine, ref: Reference, prompts: list[str], pooling: str) -> None:
    outs = engine.pool(prompts, pooling=pooling, normalize=False)
    for text, out in zip(prompts, outs, strict=True):
        ids = ref.token_ids(text)
        assert [int(t) for t in engine.tokenize([text])[0]] == ids
        worst = float(cosine(out, ref.pooled(ids, pooling)).min())  # per token for "all"
        assert worst >= MIN_COSINE, f"{pooling}, {len(ids)} tokens: cosine {worst}"


@pytest.mark.parametrize("family", BIDIRECTIONAL_FAMILIES)
@pytest.mark.parametrize("pp", [1, 2])
def test_is_causal_false_decoder_matches_the_bidirectional_reference(
    bidirectional_paths, reference, family, pp
):
    path = bidirectional_paths[family]
    ref = reference(path)  # transformers reads is_causal=false: a bidirectional mask
    prompts = long_prompts()
    budget = 16
    assert max(len(ref.token_ids(p)) for p in prompts) > 10 * budget
    with pipepool.Engine(
        str(path), pipeline_parallel_size=pp, max_num_batched_tokens=budget
    ) as engine:
        assert not engine.info.causal
        for pooling in ("last", "mean", "all"):
            _assert_matches(engine, ref, prompts, pooling)
        assert engine.stats.chunked_requests == 0  # whole prompts: they cannot be chunked


def test_the_bidirectional_check_can_tell_the_two_attentions_apart(bidirectional_paths):
    """The reference above really is bidirectional: the same weights run causally give other
    vectors (so a causal engine would fail that test)."""
    import transformers

    path = bidirectional_paths["qwen3"]
    ref = Reference(path)
    causal = transformers.AutoModel.from_pretrained(str(path), is_causal=True).eval()
    ids = ref.token_ids(long_prompts()[3])
    with torch.no_grad():
        causal_last = causal(input_ids=torch.tensor([ids])).last_hidden_state[0, -1].numpy()
    assert cosine(causal_last, ref.pooled(ids, "last")) < 0.99


def test_causal_override_runs_a_bidirectional_checkpoint_causally(bidirectional_paths):
    import transformers

    path = bidirectional_paths["qwen2"]
    ref = Reference(path)
    ref.model = transformers.AutoModel.from_pretrained(str(path), is_causal=True).eval()
    with pipepool.Engine(str(path), attention="causal", max_num_batched_tokens=16) as engine:
        assert engine.info.causal
        _assert_matches(engine, ref, long_prompts()[:4], "last")
        assert engine.stats.chunked_requests > 0


def test_remote_code_in_auto_map_is_refused_by_name(bidirectional_paths, tmp_path):
    """gte-Qwen2's config: architectures Qwen2Model, AutoModel sent to its own modeling file."""
    path = _edit_config(
        bidirectional_paths["qwen2"], tmp_path / "gte-qwen2",
        auto_map={"AutoModel": "modeling_qwen.Qwen2Model"},
    )  # fmt: skip
    with pytest.raises(pipepool.ModelLoadError, match=r"auto_map.*'modeling_qwen\.Qwen2Model'"):
        pipepool.Engine(str(path))


@pytest.mark.parametrize("pp", [1, 2])
def test_remote_code_runs_as_the_built_in_family_when_the_attention_is_named(
    bidirectional_paths, reference, tmp_path, pp
):
    source = bidirectional_paths["qwen2"]
    path = _edit_config(
        source, tmp_path / "gte-qwen2",
        auto_map={"AutoModel": "modeling_qwen.Qwen2Model"}, is_causal=None,
    )  # fmt: skip
    ref = reference(source)  # the same weights, bidirectional
    with pipepool.Engine(
        str(path), attention="bidirectional", pipeline_parallel_size=pp, max_num_batched_tokens=16
    ) as engine:
        assert not engine.info.causal
        _assert_matches(engine, ref, long_prompts(), "last")


def test_use_bidirectional_attention_on_a_family_that_ignores_it_is_refused(qwen3_path, tmp_path):
    path = _edit_config(qwen3_path, tmp_path / "q", use_bidirectional_attention=True)
    with pytest.raises(pipepool.ModelLoadError, match="use_bidirectional_attention=True"):
        pipepool.Engine(str(path))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("attn_logit_softcapping", 50.0),
        ("final_logit_softcapping", 30.0),
        ("query_pre_attn_scalar", 256),
    ],
)
def test_decoder_fields_no_family_implements_are_refused_by_name(
    qwen3_path, tmp_path, field, value
):
    path = _edit_config(qwen3_path, tmp_path / "q", **{field: value})
    with pytest.raises(pipepool.ModelLoadError, match=f"{field}={value!r}"):
        pipepool.Engine(str(path))


def test_bidirectional_sliding_window_is_refused(decoder_paths, tmp_path):
    path = _edit_config(decoder_paths["mistral"], tmp_path / "m", is_causal=False)
    with pytest.raises(pipepool.ModelLoadError, match="sliding window"):
        pipepool.Engine(str(path))


@pytest.mark.parametrize(
    ("field", "value"),
    [("is_decoder", True), ("add_cross_attention", True), ("is_causal", True)],
)
def test_encoder_fields_that_change_the_mask_are_refused(bert_path, tmp_path, field, value):
    path = _edit_config(bert_path, tmp_path / "b", **{field: value})
    with pytest.raises(pipepool.ModelLoadError, match=f"{field}={value!r}"):
        pipepool.Engine(str(path))


def test_encoders_cannot_be_made_causal(bert_path):
    with pytest.raises(pipepool.ModelLoadError, match="encoder"):
        pipepool.Engine(str(bert_path), attention="causal")


def test_model_type_contradicting_the_architecture_is_refused(qwen3_path, tmp_path):
    path = _edit_config(qwen3_path, tmp_path / "q", model_type="gemma2")
    with pytest.raises(pipepool.ModelLoadError, match="model_type 'gemma2'"):
        pipepool.Engine(str(path))


def test_attention_option_is_checked():
    with pytest.raises(pipepool.InvalidInputError, match="attention must be one of"):
        pipepool.EngineConfig(attention="sideways")


# -- sentence-transformers folders ---------------------------------------------------------


def _pylate_colbert(st_bert_path: Path, dst: Path) -> Path:
    """What PyLate saves for a ColBERT model: its own Dense module and model_type ColBERT."""
    shutil.copytree(st_bert_path, dst)
    modules = json.loads((dst / "modules.json").read_text())
    modules = [m for m in modules if not m["type"].endswith(("Pooling", "Normalize"))]
    for module in modules:
        if module["type"].endswith("Dense"):
            module["type"] = "pylate.models.Dense.Dense"
    (dst / "modules.json").write_text(json.dumps(modules))
    st_config = json.loads((dst / "config_sentence_transformers.json").read_text())
    st_config["model_type"] = "ColBERT"
    (dst / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    return dst


def test_pylate_colbert_folder_is_refused_not_pooled(st_bert_path, tmp_path):
    path = _pylate_colbert(st_bert_path, tmp_path / "colbert")
    with pytest.raises(pipepool.ModelLoadError, match="ColBERT"):
        pipepool.Engine(str(path))


def test_a_module_of_another_package_is_refused_by_its_full_name(st_bert_path, tmp_path):
    path = _pylate_colbert(st_bert_path, tmp_path / "colbert")
    st_config = json.loads((path / "config_sentence_transformers.json").read_text())
    st_config["model_type"] = "SentenceTransformer"
    (path / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    with pytest.raises(pipepool.ModelLoadError, match=r"'pylate\.models\.Dense\.Dense'"):
        pipepool.Engine(str(path))


def test_sparse_encoder_folder_is_refused_by_name(st_bert_path, tmp_path):
    path = shutil.copytree(st_bert_path, tmp_path / "splade")
    st_config = json.loads((path / "config_sentence_transformers.json").read_text())
    st_config["model_type"] = "SparseEncoder"
    (path / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    with pytest.raises(pipepool.ModelLoadError, match="SparseEncoder"):
        pipepool.Engine(str(path))


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"do_lower_case": True}, "do_lower_case"),
        ({"config_kwargs": {"is_causal": True}}, "config_kwargs"),
        ({"transformer_task": "fill-mask"}, "transformer_task 'fill-mask'"),
        ({"config_args": {"is_causal": True}}, "config_args"),
        ({"model_kwargs": {"rope_scaling": {"factor": 2}}}, "model_kwargs sets 'rope_scaling'"),
        ({"tokenizer_args": {"do_lower_case": True}}, "tokenizer_args sets 'do_lower_case'"),
        ({"processing_kwargs": {"text": {"padding": True}}}, "processing_kwargs"),
        ({"query_expansion": True}, "query_expansion"),
    ],
)
def test_transformer_module_settings_that_change_the_output_are_refused(
    st_bert_path, tmp_path, setting, message
):
    path = shutil.copytree(st_bert_path, tmp_path / "st")
    bert_config = path / "sentence_bert_config.json"
    bert_config.write_text(json.dumps({**json.loads(bert_config.read_text()), **setting}))
    with pytest.raises(pipepool.ModelLoadError, match=message):
        pipepool.Engine(str(path))


def test_harmless_transformer_module_settings_load(st_bert_path, tmp_path):
    """Loading options and the precision sentence-transformers passes on do not change the
    math: a folder that names them loads."""
    path = shutil.copytree(st_bert_path, tmp_path / "st")
    bert_config = path / "sentence_bert_config.json"
    settings = {
        "model_kwargs": {"torch_dtype": "auto", "attn_implementation": "sdpa"},
        "tokenizer_args": {"use_fast": True},
    }
    bert_config.write_text(json.dumps({**json.loads(bert_config.read_text()), **settings}))
    with pipepool.Engine(str(path)) as engine:
        assert engine.embed(["loads"]).shape == (1, 32)


def test_the_sentence_transformers_folder_still_matches_after_the_checks(st_bert_path):
    from sentence_transformers import SentenceTransformer

    texts = long_prompts()[:4]
    expected = SentenceTransformer(str(st_bert_path), device="cpu").encode(texts)
    with pipepool.Engine(str(st_bert_path)) as engine:
        got = pipepool.SentenceTransformer(engine).encode(texts)
    assert np.min(cosine(got, expected)) >= MIN_COSINE


def test_parity_command_checks_a_remote_code_checkpoint_run_as_its_family(
    bidirectional_paths, tmp_path, capsys
):
    """``pipepool parity --attention bidirectional`` on gte-Qwen2's kind of config: the
    reference is transformers' built-in Qwen2 with that attention, and every PP and budget
    agrees with it."""
    from pipepool.commands.cli import main

    path = _edit_config(
        bidirectional_paths["qwen2"], tmp_path / "gte-qwen2",
        auto_map={"AutoModel": "modeling_qwen.Qwen2Model"}, is_causal=None,
    )  # fmt: skip
    out = tmp_path / "parity.json"
    args = ["parity", "--model", str(path), "--pp", "1,2", "--max-num-batched-tokens", "16"]
    rc = main([*args, "--max-model-len", "256", "--attention", "bidirectional", "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0, capsys.readouterr().out
    assert report["passed"] and all(r["chunked"] == 0 for r in report["rows"])
    # Without the option the checkpoint is refused, naming the remote class.
    rc = main(["parity", "--model", str(path), "--pp", "1", "--max-model-len", "256"])
    captured = capsys.readouterr()
    assert rc != 0 and "modeling_qwen.Qwen2Model" in captured.out + captured.err
