"""SigLIP2 (NaFlex) against transformers on the same weights (fp32 CPU): images of several
aspect ratios, each its own number of patches, through the vision tower at PP 1 and 2; texts
through SigLIP's text tower with a budget small enough that steps hold several prompts; the
plan rows against ``Siglip2ImageProcessorPil``; and what a folder may not ask for."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import MIN_COSINE, SENTENCES, cosine
from tiny_towers import NAFLEX_PATCHES, PATCH, make_siglip2, sample_images

import pipepool
from pipepool.errors import ModelLoadError


@pytest.fixture(scope="module")
def siglip2_path(model_dir) -> Path:
    return make_siglip2(model_dir / "siglip2")


def _reference(path: Path):
    import transformers

    model = transformers.Siglip2Model.from_pretrained(path).eval()
    return model, transformers.Siglip2ImageProcessorPil.from_pretrained(path)


def _images() -> list:
    """The shared samples plus a panorama and a tall strip: grids of 1 x 16 and 16 x 1."""
    from PIL import Image

    rng = np.random.default_rng(1)
    wide = Image.fromarray(rng.integers(0, 256, (9, 300, 3), dtype=np.uint8))
    tall = Image.fromarray(rng.integers(0, 256, (260, 12, 3), dtype=np.uint8))
    return [*sample_images(), wide, tall]


@pytest.mark.parametrize(("pp", "budget"), [(1, 16), (2, 16), (1, 8192)])
def test_siglip2_matches_transformers(siglip2_path, pp, budget):
    """Budget 16: about one image a step; 8192: images of several grids share a step (the
    attention head pools each over its own rows)."""
    model, processor = _reference(siglip2_path)
    images = _images()
    texts = SENTENCES[:5]
    with pipepool.Engine(
        str(siglip2_path), pipeline_parallel_size=pp, max_num_batched_tokens=budget
    ) as engine:
        image_vectors = engine.embed(images, normalize=False)
        text_vectors = engine.embed(texts, normalize=False)
        ids = engine.tokenize(texts)
    with torch.no_grad():
        rgb = [image.convert("RGB") for image in images]  # the processor converts nothing
        batch = processor(images=rgb, return_tensors="pt")
        grids = {tuple(shape) for shape in batch["spatial_shapes"].tolist()}
        want_images = model.get_image_features(**batch).pooler_output.numpy()
        want_texts = np.concatenate([
            model.get_text_features(input_ids=torch.tensor(np.asarray(i))[None]).pooler_output.numpy()
            for i in ids
        ])  # fmt: skip
    assert len(grids) > 3, f"images of several patch grids: {grids}"
    worst_image = float(cosine(image_vectors, want_images).min())
    worst_text = float(cosine(text_vectors, want_texts).min())
    assert worst_image >= MIN_COSINE, f"PP={pp} images: cosine {worst_image}"
    assert worst_text >= MIN_COSINE, f"PP={pp} texts: cosine {worst_text}"


def test_plan_rows_equal_processor(siglip2_path):
    """Each image's rows hold exactly the processor's patch values (its unpadded patches) and
    its patch grid."""
    from pipepool.intake.naflex_images import NaFlexProcessing

    _, processor = _reference(siglip2_path)
    processing = NaFlexProcessing.from_folder(siglip2_path, PATCH, NAFLEX_PATCHES)
    values = 3 * PATCH * PATCH
    width = -(-(values + 2) // 2)
    for image in _images():
        want = processor(images=[image.convert("RGB")], return_tensors="np")
        rows, columns = want["spatial_shapes"][0]
        got = processing.rows(image, width).view(np.float32)
        assert got.shape[0] == rows * columns
        np.testing.assert_array_equal(got[:, :values], want["pixel_values"][0][: rows * columns])
        assert (got[:, values : values + 2] == (rows, columns)).all()


def test_refuses_what_it_does_not_implement(siglip2_path, tmp_path):
    """A processor budget above the position table, and a processor key pipepool does not
    read, are refused at load by name."""
    import shutil

    for key, value, named in (("max_num_patches", 4 * NAFLEX_PATCHES, "max_num_patches"),
                              ("do_pad", True, "do_pad")):  # fmt: skip
        folder = tmp_path / key
        shutil.copytree(siglip2_path, folder)
        config_file = folder / "preprocessor_config.json"
        config = json.loads(config_file.read_text())
        config[key] = value
        config_file.write_text(json.dumps(config))
        with pytest.raises(ModelLoadError, match=named), pipepool.Engine(str(folder)):
            pass


def test_parity_command_compares_both_towers(siglip2_path, tmp_path, capsys):
    """``pipepool parity`` on a dual encoder: a text row and an image row per configuration,
    each against transformers; a chosen pooling is refused (the towers pool as they do)."""
    from pipepool.commands.cli import main

    out = tmp_path / "parity.json"
    args = ["parity", "--model", str(siglip2_path), "--pp", "1,2"]
    rc = main([*args, "--max-num-batched-tokens", "16", "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0, report
    assert [r["pooling"] for r in report["rows"]] == ["text", "image"] * 2
    assert all(r["passed"] and r["min_cosine"] >= MIN_COSINE for r in report["rows"])
    texts = sum(not p["preview"].startswith("<image") for p in report["prompts"])
    assert all(r["worst_request"] >= texts for r in report["rows"] if r["pooling"] == "image")
    assert "Siglip2Model.get_text_features" in report["reference"]
    capsys.readouterr()
    assert main([*args, "--pooling", "mean"]) == 2
    assert "poolings cannot be chosen" in capsys.readouterr().err
