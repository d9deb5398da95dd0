"""Qwen3-VL as an embedding model against transformers' ``Qwen3VLModel`` on the same weights
(fp32 CPU): texts with images, formatted by the folder's processor, pooled at their last token,
at PP=1 and PP=2 (stage processes) with an 8-token budget, so that every image's placeholder
tokens span several steps. The tiny checkpoint (``tiny_vlm.make_qwen3_vl``) has DeepStack into
decoder layers 0-2: at PP=2 the first stage sends the second one the rows of layer 2 (and, with
three layers, the last layer adds them, so the last stage keeps every row). Also: the
preprocessing and interleaved M-RoPE positions against the processor's and ``get_rope_index``'s;
a stage applying other positions caught by the lockstep checks (the DeepStack rows it receives
no longer match the plan); videos and configs the family does not compute refused by name."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_lockstep import SteppedPipeline
from tiny_models import MIN_COSINE, SENTENCES, cosine, long_prompts
from tiny_towers import png_bytes, sample_images
from tiny_vlm import (
    instructed_inputs,
    make_qwen3_vl,
    reference,
    reference_inputs,
    reference_vectors,
)

import pipepool
from pipepool import StateDivergence
from pipepool.errors import InvalidInputError, ModelLoadError

BUDGET = 8


@pytest.fixture(scope="module")
def qwen3_vl_path(model_dir) -> Path:
    return make_qwen3_vl(model_dir / "qwen3_vl")


@pytest.fixture(scope="module")
def qwen3_vl_reference(qwen3_vl_path):
    return reference(qwen3_vl_path, "qwen3_vl")


def _inputs() -> list:
    images = sample_images()
    return [
        {"text": "a photo of a cat", "image": images[0]},
        {"text": SENTENCES[1]},
        {"images": [images[1], images[4]], "text": long_prompts()[0]},
        {"image": png_bytes(images[2])},
        {"text": "two views", "images": [images[3], images[0]]},
    ]


@pytest.fixture(scope="module")
def qwen3_vl_wanted(qwen3_vl_reference):
    """transformers' vectors of ``_inputs()`` and of plain texts, its every-token states of
    input 2, and each input's placeholder count (computed once for both PP degrees)."""
    model, processor = qwen3_vl_reference
    items, texts = _inputs(), SENTENCES[:3] + long_prompts()[:1]
    with torch.no_grad():  # every token's state, the image tokens' DeepStack sums included
        tokens = model(**reference_inputs(processor, items[2])).last_hidden_state[0].numpy()
    placeholders = [
        int((reference_inputs(processor, i)["input_ids"] == model.config.image_token_id).sum())
        for i in items
    ]
    return (reference_vectors(model, processor, items), reference_vectors(model, processor, texts),
            tokens, placeholders)  # fmt: skip


@pytest.mark.parametrize("pp", [1, 2])
def test_qwen3_vl_matches_transformers(qwen3_vl_path, qwen3_vl_wanted, pp):
    want, want_texts, want_tokens, placeholders = qwen3_vl_wanted
    items, texts = _inputs(), SENTENCES[:3] + long_prompts()[:1]
    assert max(placeholders) > 2 * BUDGET  # an image's placeholders span three steps or more
    with pipepool.Engine(
        str(qwen3_vl_path), pipeline_parallel_size=pp, max_num_batched_tokens=BUDGET
    ) as engine:
        got = engine.embed(items)
        got_texts = engine.embed(texts)
        mixed = engine.embed(items[:2] + [{"text": t} for t in texts[:1]], normalize=False)
        tokens = engine.embed_tokens([items[2]])[0]
    worst = float(cosine(got, want).min())
    assert worst >= MIN_COSINE, f"PP={pp}: cosine {worst}"
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)  # normalised
    worst_text = float(cosine(got_texts, want_texts).min())
    assert worst_text >= MIN_COSINE, f"PP={pp} texts: cosine {worst_text}"
    assert float(cosine(mixed[:2], want[:2]).min()) >= MIN_COSINE
    assert float(cosine(tokens, want_tokens).min()) >= MIN_COSINE


def test_deepstack_into_the_last_layer(model_dir):
    """Three decoder layers, all adding DeepStack rows: at PP=2 the last stage's only layer
    adds the rows the first stage sent, and its last layer's output is needed at every image
    token (no rows dropped before the last layer's MLP)."""
    path = make_qwen3_vl(model_dir / "qwen3_vl_3", num_layers=3)
    model, processor = reference(path, "qwen3_vl")
    items = _inputs()[:3]
    want = reference_vectors(model, processor, items)
    with pipepool.Engine(
        str(path), pipeline_parallel_size=2, max_num_batched_tokens=BUDGET
    ) as engine:
        got = engine.embed(items)
    worst = float(cosine(got, want).min())
    assert worst >= MIN_COSINE, f"DeepStack into the last layer: cosine {worst}"


def test_a_qwen3_vl_model_saved_alone(qwen3_vl_path, qwen3_vl_reference, tmp_path):
    """``Qwen3VLModel.save_pretrained`` (architecture Qwen3VLModel, tensors under
    ``language_model.`` and ``visual.``) loads and embeds as transformers does."""
    model, processor = qwen3_vl_reference
    folder = tmp_path / "model_only"
    model.save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json",
                 "chat_template.jinja"):  # fmt: skip
        shutil.copy(qwen3_vl_path / name, folder / name)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3VLModel"]
    items = _inputs()[:2]
    with pipepool.Engine(str(folder)) as engine:
        got = engine.embed(items)
    assert float(cosine(got, reference_vectors(model, processor, items)).min()) >= MIN_COSINE


def test_preprocessing_and_positions_equal_transformers(qwen3_vl_path, qwen3_vl_reference):
    """pixel_values, image_grid_thw and input_ids equal Qwen3VLProcessor's exactly; the media
    rows' positions equal Qwen3VLModel.get_rope_index's."""
    from pipepool.intake.images import ImageLimits
    from pipepool.intake.vlm_inputs import VlmFormatter

    model, processor = qwen3_vl_reference
    formatter = VlmFormatter(
        qwen3_vl_path, qwen3_vl_path / "tokenizer.json", model.config.image_token_id,
        ImageLimits(None, 10**8),
    )  # fmt: skip
    for index, item in enumerate(_inputs()):
        want = reference_inputs(processor, item)
        images = item.get("images", [item["image"]] if "image" in item else [])
        got = formatter.prompt(item.get("text", ""), formatter.decode(images, index), index)
        np.testing.assert_array_equal(got.token_ids, want["input_ids"][0].numpy())
        if images:
            np.testing.assert_array_equal(
                np.concatenate([i.pixels for i in got.images]), want["pixel_values"].numpy()
            )
            np.testing.assert_array_equal([i.grid for i in got.images],
                                          want["image_grid_thw"].numpy())  # fmt: skip
            positions, _ = model.get_rope_index(
                want["input_ids"], want["mm_token_type_ids"], want["image_grid_thw"]
            )
            np.testing.assert_array_equal(got.media[:, :3].T, positions[:, 0].numpy())


def _stepped_request(pipe: SteppedPipeline, path: Path):
    """One input with two images, as a batch of the stepped pipeline."""
    from pipepool.core.request import PoolingParams, RequestBatch
    from pipepool.intake.images import ImageLimits
    from pipepool.intake.vlm_inputs import VlmFormatter

    config = json.loads((path / "config.json").read_text())
    formatter = VlmFormatter(path, path / "tokenizer.json", config["image_token_id"],
                             ImageLimits(None, 10**8))  # fmt: skip
    item = _inputs()[2]
    prompt = formatter.prompt(item["text"], formatter.decode(item["images"], 0), 0)
    batch = RequestBatch(
        0, prompt.token_ids, np.array([len(prompt.token_ids)]), PoolingParams(pooling="last"),
        media=prompt.media, images=[prompt.images],
    )  # fmt: skip
    pipe.scheduler.add(batch)


@pytest.mark.parametrize(
    ("stage", "check", "says"),
    [
        (0, "mirror", "image placeholder"),
        (1, "neighbour", "DeepStack rows of the plan's image tokens"),
    ],
)
def test_a_stage_applying_other_positions_is_caught(qwen3_vl_path, monkeypatch, stage, check, says):
    """A stage that takes its step as text (1-D positions, no image rows) is named before it
    computes: the first stage by its placeholder check, the second because the DeepStack rows
    it receives belong to image tokens its plan no longer has."""
    pipe = SteppedPipeline(qwen3_vl_path, pp=2, fault=("text_positions_on_stage", stage),
                           monkeypatch=monkeypatch)  # fmt: skip
    _stepped_request(pipe, qwen3_vl_path)
    with pytest.raises(StateDivergence) as info:
        while True:
            pipe.run(pipe.plan())
    err = info.value
    assert (err.check, err.stage) == (check, stage)
    assert says in str(err)


def test_no_fault_no_divergence(qwen3_vl_path):
    pipe = SteppedPipeline(qwen3_vl_path, pp=2)
    _stepped_request(pipe, qwen3_vl_path)
    while pipe.scheduler.has_schedulable():
        pipe.run(pipe.plan())
    assert pipe.scheduler.num_admitted == 0


def test_videos_are_refused_by_name(qwen3_vl_path):
    with pipepool.Engine(str(qwen3_vl_path)) as engine:
        good = {"text": "fine", "image": sample_images()[1]}
        for key in ("video", "videos"):
            with pytest.raises(InvalidInputError, match=rf"input 1: '{key}': video inputs"):
                engine.embed([good, {"text": "x", key: [b"frames"]}])
        assert engine.embed([good]).shape == (1, 64)  # the engine goes on serving


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda c: c["text_config"]["rope_parameters"].update(mrope_interleaved=False),
         "mrope_interleaved=False"),
        (lambda c: c["text_config"]["rope_parameters"].update(rope_type="yarn", factor=2.0),
         "rope type 'yarn'"),
        (lambda c: c["vision_config"].update(deepstack_visual_indexes=[2, 0]),
         "deepstack_visual_indexes=[2, 0]"),
        (lambda c: c["vision_config"].update(num_position_embeddings=15),
         "num_position_embeddings=15"),
    ],
)  # fmt: skip
def test_configs_it_does_not_compute_are_refused(qwen3_vl_path, tmp_path, edit, says):
    folder = tmp_path / "edited"
    shutil.copytree(qwen3_vl_path, folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=re.escape(says)):
        pipepool.Engine(str(folder))


@pytest.mark.slow
def test_parity_on_texts_and_images(qwen3_vl_path, tmp_path, capsys):
    """``pipepool parity`` on a Qwen3-VL folder: texts (token ids and dicts), images and texts
    with images at PP 1 and 2 with a 16-token budget (each input chunked; at PP=2 the second
    stage adds DeepStack rows it received), against transformers' Qwen3VLModel."""
    from pipepool.commands.cli import main

    out = tmp_path / "parity.json"
    rc = main([
        "parity", "--model", str(qwen3_vl_path), "--pp", "1,2", "--max-num-batched-tokens",
        "16", "--pooling", "last", "--max-model-len", "256", "--json", str(out),
    ])  # fmt: skip
    assert rc == 0, capsys.readouterr().out
    report = json.loads(out.read_text())
    assert "Qwen3VLModel (Qwen3VLProcessor without videos)" in report["reference"]
    groups = ["text", "text-dict", "image", "text+image"]
    assert [(r["pp"], r["pooling"], r["passed"]) for r in report["rows"]] == [
        (pp, f"{g} last", True) for pp in (1, 2) for g in groups
    ]
    assert all(r["chunked"] >= 2 and r["min_cosine"] >= MIN_COSINE for r in report["rows"])


def test_instruction_as_qwen3_vl_embedding_writes_it(qwen3_vl_path, qwen3_vl_reference):
    """A dict input's ``instruction`` is Qwen3-VL-Embedding's system message (its reference
    code's ``format_model_input``): transformers' hidden state at the last token of the
    processor's rendering with that system message, cos >= 0.99999, with images cut by the
    budget; the same input without it is another vector (the template's default system turn)."""
    items = instructed_inputs()
    want = reference_vectors(*qwen3_vl_reference, items)
    with pipepool.Engine(str(qwen3_vl_path), max_num_batched_tokens=BUDGET) as engine:
        got = engine.embed(items)
        plain = engine.embed([{k: v for k, v in items[0].items() if k != "instruction"}])
        for bad in ("", "   ", 3):
            with pytest.raises(InvalidInputError, match="input 0: 'instruction' is not a non-"):
                engine.embed([{"text": "x", "instruction": bad}])
    assert float(cosine(got, want).min()) >= MIN_COSINE
    assert float(cosine(plain, want[:1])[0]) < 0.999
