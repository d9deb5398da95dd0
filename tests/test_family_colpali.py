"""ColPali against transformers' ``ColPaliForRetrieval`` and ``ColPaliProcessor`` on the same
weights (fp32 CPU): per-token vectors of queries and pages, and MaxSim against the processor's
``score_retrieval``, at PP=1 and PP=2 (stage processes) with an 8-token budget, below every
prompt's length, so each runs alone in a step of its own (the decoder is bidirectional over the
whole prompt: no prompt chunks); the prompts and pixel values against the processor's; and the
inputs and checkpoints refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_colpali import colpali_reference, make_colpali
from tiny_models import MIN_COSINE, SENTENCES, cosine
from tiny_towers import png_bytes, sample_images

import pipepool
from pipepool.errors import InvalidInputError, ModelLoadError

BUDGET = 8


@pytest.fixture(scope="module")
def colpali_path(model_dir) -> Path:
    return make_colpali(model_dir / "colpali")


@pytest.fixture(scope="module")
def colpali_ref(colpali_path):
    return colpali_reference(colpali_path)


def _queries() -> list[str]:
    return ["a cat", SENTENCES[2], "which page shows the chart"]


@pytest.mark.parametrize("pp", [1, 2])
def test_colpali_matches_transformers(colpali_path, colpali_ref, pp):
    """Token vectors of pages and queries (cosine per token, unit norms) and MaxSim (score,
    rerank) against ColPaliForRetrieval on its processor's inputs and score_retrieval, one
    query and one page at a time (score_retrieval pads a batch of pages with zero vectors)."""
    model, processor = colpali_ref
    pages, queries = sample_images()[:4], _queries()
    with torch.no_grad():
        want_pages = [model(**processor.process_images(images=[p])).embeddings[0] for p in pages]
        want_queries = [model(**processor.process_queries(text=[q])).embeddings[0] for q in queries]
    assert min(len(w) for w in want_pages + want_queries) > BUDGET  # each alone in its step
    want = np.array([[float(processor.score_retrieval([q], [p])[0, 0]) for p in want_pages]
                     for q in want_queries])  # fmt: skip
    with pipepool.Engine(
        str(colpali_path), pipeline_parallel_size=pp, max_num_batched_tokens=BUDGET
    ) as engine:
        got_pages = engine.embed_tokens(
            [{"image": p} for p in pages[:3]] + [{"image": png_bytes(pages[3])}], normalize=True
        )
        got_queries = engine.pool([{"text": q} for q in queries], pooling="all")
        plain = engine.embed_tokens(queries[:1] + pages[:1])  # the projection, unnormalised
        one_to_many = engine.score(queries[0], pages)
        pairwise = engine.score(queries, pages[:3])
        ranked = engine.rerank(queries[1], pages, top_n=2)
    for got, expected in zip(got_pages + got_queries, want_pages + want_queries, strict=True):
        assert got.shape == tuple(expected.shape)
        assert float(cosine(got, expected.numpy()).min()) >= MIN_COSINE, f"PP={pp}"
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
    for got, expected in zip(plain, [want_queries[0], want_pages[0]], strict=True):
        assert float(cosine(got, expected.numpy()).min()) >= MIN_COSINE  # a text: a query
        assert float(np.abs(np.linalg.norm(got, axis=1) - 1).max()) > 1e-3
    np.testing.assert_allclose(one_to_many, want[0], atol=1e-4)
    np.testing.assert_allclose(pairwise, np.diag(want[:, :3]), atol=1e-4)
    assert [r.index for r in ranked] == np.argsort(-want[1], kind="stable")[:2].tolist()
    np.testing.assert_allclose([r.relevance_score for r in ranked],
                               np.sort(want[1])[::-1][:2], atol=1e-4)  # fmt: skip


def test_prompts_and_pixels_equal_the_processor(colpali_path, colpali_ref, tmp_path):
    """Token ids of queries and pages, and a page's patches, as ColPaliProcessor makes them
    (RGB whatever the config's do_convert_rgb: the processor always asks for it); positions
    are each token's index (the stages count from 1, as PaliGemma does)."""
    from pipepool.intake.colpali_inputs import ColPaliFormatter
    from pipepool.intake.images import ImageLimits

    model, processor = colpali_ref
    cfg = model.config.vlm_config
    folder = shutil.copytree(colpali_path, tmp_path / "null_rgb")
    settings = json.loads((folder / "processor_config.json").read_text())
    settings["image_processor"]["do_convert_rgb"] = None  # as the published folders say
    (folder / "processor_config.json").write_text(json.dumps(settings))
    formatter = ColPaliFormatter(
        folder, folder / "tokenizer.json", cfg.image_token_id,
        ImageLimits(None, 10**8), image_size=cfg.vision_config.image_size,
        patch_size=cfg.vision_config.patch_size,
    )  # fmt: skip
    for query in _queries():
        want = processor.process_queries(text=[query])["input_ids"][0].numpy()
        got = formatter.prompt(query, [], 0)
        np.testing.assert_array_equal(got.token_ids, want)
        np.testing.assert_array_equal(got.media[:, 0], np.arange(len(want)))
    for image in sample_images():
        batch = processor.process_images(images=[image])
        got = formatter.prompt("", [image], 0)
        np.testing.assert_array_equal(got.token_ids, batch["input_ids"][0].numpy())
        p = cfg.vision_config.patch_size
        pixels = batch["pixel_values"][0].numpy()  # [C, H, W] -> patches, row-major
        c, h, w = pixels.shape
        patches = pixels.reshape(c, h // p, p, w // p, p).transpose(1, 3, 0, 2, 4)
        np.testing.assert_array_equal(got.images[0].pixels, patches.reshape(-1, c * p * p))
        image_rows = got.token_ids == cfg.image_token_id
        np.testing.assert_array_equal(got.media[image_rows, 3], np.arange(1, image_rows.sum() + 1))


@pytest.fixture(scope="module")
def colpali_engine(colpali_path):
    with pipepool.Engine(str(colpali_path)) as engine:
        yield engine


def test_queries_and_pages_sharing_steps(colpali_engine, colpali_ref):
    """With the default budget, queries and pages of one call share a step (each its own
    positions from 1 and its own bidirectional attention); plain texts are queries, images
    pages, as in the processor's formats."""
    model, processor = colpali_ref
    pages, queries = sample_images()[:2], _queries()
    with torch.no_grad():
        want = [model(**processor.process_queries(text=[q])).embeddings[0] for q in queries]
        want += [model(**processor.process_images(images=[p])).embeddings[0] for p in pages]
    got = colpali_engine.pool([*queries, *pages], pooling="all")
    for g, w in zip(got, want, strict=True):
        assert float(cosine(g, w.numpy()).min()) >= MIN_COSINE


def test_colpali_refusals(colpali_engine):
    engine, image = colpali_engine, sample_images()[0]
    with pytest.raises(InvalidInputError, match="input 0: ColPali embeds a query"):
        engine.pool([{"text": "x", "image": image}], pooling="all")
    with pytest.raises(InvalidInputError, match="input 1: ColPali embeds a query"):
        engine.pool([{"image": image}, {"images": [image, image]}], pooling="all")
    with pytest.raises(InvalidInputError, match="ColPali gives one vector per token"):
        engine.pool([{"image": image}], pooling="mean")
    with pytest.raises(InvalidInputError, match="dimensions: ColPali's token vectors"):
        engine.pool([{"image": image}], pooling="all", dimensions=8)
    with pytest.raises(InvalidInputError, match="input 0: placeholder runs"):
        engine.pool([{"text": "look <image> here"}], pooling="all")  # not an image of its own
    with pytest.raises(InvalidInputError, match=r"pages .* are images .*; input 1 is not"):
        engine.score("a query", [image, "a text page"])
    with pytest.raises(InvalidInputError, match="instruction does not apply"):
        engine.score("a query", [image], instruction="find it")


def _edited(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_tensor_names_of_earlier_saves(colpali_path, colpali_engine, tmp_path):
    """The hub's ColPali folders (saved by transformers 4) name the vision tower's tensors
    ``vlm.vision_tower.vision_model.*``; transformers 5's in-memory names drop the
    ``.model`` after ``language_model``: both load to the same vectors."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(colpali_path / "model.safetensors")
    renames = (("vlm.vision_tower.", "vlm.vision_tower.vision_model."),
               ("vlm.language_model.model.", "vlm.language_model."))  # fmt: skip
    for old, new in renames:
        folder = shutil.copytree(colpali_path, tmp_path / new.replace(".", "_"))
        renamed = {new + k[len(old) :] if k.startswith(old) else k: v for k, v in tensors.items()}
        assert renamed.keys() != tensors.keys()
        save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})
        page = {"image": sample_images()[1]}
        with pipepool.Engine(str(folder)) as engine:
            got = engine.pool([page], pooling="all")[0]
        np.testing.assert_array_equal(got, colpali_engine.pool([page], pooling="all")[0])


def test_checkpoints_refused_by_name(colpali_path, tmp_path):
    """PaliGemma 2's Gemma2 decoder, causal attention and a processor whose image token count
    is not the tower's patches are refused at load, naming what."""

    def gemma2(config):
        config["vlm_config"]["text_config"]["model_type"] = "gemma2"

    with pytest.raises(ModelLoadError, match="'gemma2' decoder"):
        pipepool.Engine(str(_edited(colpali_path, tmp_path / "g2", gemma2)))
    with pytest.raises(ModelLoadError, match="encoder; attention='causal'"):
        pipepool.Engine(str(colpali_path), attention="causal")
    seq = _edited(colpali_path, tmp_path / "seq", lambda config: None)
    processor = json.loads((seq / "processor_config.json").read_text())
    processor["image_processor"]["image_seq_length"] = 9
    (seq / "processor_config.json").write_text(json.dumps(processor))
    with pytest.raises(ModelLoadError, match="image_seq_length 9 differs"):
        pipepool.Engine(str(seq))


def test_a_first_stage_without_the_image_rows_is_caught(colpali_path, monkeypatch):
    """A first stage whose plan lost its image rows (it would embed the image tokens as text)
    is named before computing: its placeholders read no image row."""
    import faults

    from pipepool import StateDivergence

    faults.install(monkeypatch, "text_positions_on_stage", stage=0)
    engine = pipepool.Engine(
        str(colpali_path), pipeline_parallel_size=2, max_num_batched_tokens=BUDGET,
        pipeline_backend="inproc",
    )  # fmt: skip
    with engine, pytest.raises(StateDivergence) as info:
        engine.pool([{"image": sample_images()[0]}], pooling="all")
    assert (info.value.check, info.value.stage) == ("mirror", 0)
    assert "image placeholder" in str(info.value)
