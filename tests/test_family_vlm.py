"""Vision-language models against transformers on the same weights (fp32 CPU). Qwen2-VL and
Qwen2.5-VL: texts with images, formatted by the folder's processor, pooled at their last token,
at PP=1 and PP=2 (stage processes) with an 8-token budget, so that every image's placeholder
tokens span several steps; the preprocessing and M-RoPE positions against the processor's and
``get_rope_index``'s; a stage that applies other positions caught by the lockstep checks;
ColQwen2's token vectors and MaxSim against ``ColQwen2ForRetrieval`` and its processor's
``score_retrieval``; and the inputs refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_lockstep import SteppedPipeline
from tiny_models import MIN_COSINE, SENTENCES, cosine, long_prompts
from tiny_towers import png_bytes, sample_images
from tiny_vlm import (
    colqwen2_reference,
    instructed_inputs,
    make_colqwen2,
    make_qwen2_vl,
    reference,
    reference_inputs,
    reference_vectors,
)

import pipepool
from pipepool import StateDivergence
from pipepool.errors import InvalidInputError, ModelLoadError

BUDGET = 8


@pytest.fixture(scope="module")
def vlm_path(model_dir) -> Path:
    return make_qwen2_vl(model_dir / "qwen2_vl")


@pytest.fixture(scope="module")
def vlm_reference(vlm_path):
    return reference(vlm_path)


def _inputs() -> list:
    images = sample_images()
    return [
        {"text": "a photo of a cat", "image": images[0]},
        {"text": SENTENCES[1]},
        {"images": [images[1], images[4]], "text": long_prompts()[0]},
        {"image": png_bytes(images[2])},
        {"text": "two views", "images": [images[3], images[0]]},
    ]


@pytest.mark.parametrize("pp", [1, 2])
def test_vlm_matches_transformers(vlm_path, vlm_reference, pp):
    model, processor = vlm_reference
    items, texts = _inputs(), SENTENCES[:3] + long_prompts()[:1]
    want = reference_vectors(model, processor, items)
    want_texts = reference_vectors(model, processor, texts)
    placeholders = [
        int((reference_inputs(processor, i)["input_ids"] == model.config.image_token_id).sum())
        for i in items
    ]
    assert max(placeholders) > 2 * BUDGET  # an image's placeholders span three steps or more
    with pipepool.Engine(
        str(vlm_path), pipeline_parallel_size=pp, max_num_batched_tokens=BUDGET
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
    with torch.no_grad():  # every token's state, placeholders included
        want_tokens = model(**reference_inputs(processor, items[2])).last_hidden_state[0]
    assert float(cosine(tokens, want_tokens.numpy()).min()) >= MIN_COSINE


def test_qwen2_5_vl_matches_transformers(model_dir):
    """Qwen2.5-VL: the same decoder and inputs, its vision tower windowed (windows of 2 x 2
    merge blocks, one block over the whole image), at PP=2 with the 8-token budget."""
    path = make_qwen2_vl(model_dir / "qwen2_5_vl", kind="qwen2_5_vl")
    model, processor = reference(path, "qwen2_5_vl")
    items = _inputs()
    want = reference_vectors(model, processor, items)
    with pipepool.Engine(
        str(path), pipeline_parallel_size=2, max_num_batched_tokens=BUDGET
    ) as engine:
        got = engine.embed(items)
    worst = float(cosine(got, want).min())
    assert worst >= MIN_COSINE, f"Qwen2.5-VL: cosine {worst}"


def test_a_qwen2_vl_model_saved_alone(vlm_path, vlm_reference, tmp_path):
    """``Qwen2VLModel.save_pretrained`` (architecture Qwen2VLModel, tensors under
    ``language_model.`` and ``visual.``) loads and embeds as transformers does."""
    model, processor = vlm_reference
    folder = tmp_path / "model_only"
    model.save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json",
                 "chat_template.jinja"):  # fmt: skip
        shutil.copy(vlm_path / name, folder / name)
    items = _inputs()[:2]
    with pipepool.Engine(str(folder)) as engine:
        got = engine.embed(items)
    assert float(cosine(got, reference_vectors(model, processor, items)).min()) >= MIN_COSINE


def test_preprocessing_and_positions_equal_transformers(vlm_path, vlm_reference):
    """pixel_values, image_grid_thw and input_ids equal the processor's exactly; the media rows'
    positions equal ``get_rope_index``'s."""
    from pipepool.intake.images import ImageLimits
    from pipepool.intake.vlm_inputs import VlmFormatter

    model, processor = vlm_reference
    formatter = VlmFormatter(
        vlm_path, vlm_path / "tokenizer.json", model.config.image_token_id,
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
        rows = got.media[:, 3]
        assert np.array_equal(rows > 0, got.token_ids == model.config.image_token_id)
        assert np.array_equal(rows[rows > 0], np.arange(1, int((rows > 0).sum()) + 1))


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
        (1, "driver", "M-RoPE positions"),
    ],
)
def test_a_stage_applying_other_positions_is_caught(vlm_path, monkeypatch, stage, check, says):
    """A stage that rotates by 1-D positions (as if the images were not there) is named: the
    first stage before computing (its placeholders would read no image row), the last by the
    driver (the positions it applied are not the plan's, in its digest)."""
    pipe = SteppedPipeline(vlm_path, pp=2, fault=("text_positions_on_stage", stage),
                           monkeypatch=monkeypatch)  # fmt: skip
    _stepped_request(pipe, vlm_path)
    with pytest.raises(StateDivergence) as info:
        while True:
            pipe.run(pipe.plan())
    err = info.value
    assert (err.check, err.stage) == (check, stage)
    assert says in str(err)


def test_no_fault_no_divergence(vlm_path):
    pipe = SteppedPipeline(vlm_path, pp=2)
    _stepped_request(pipe, vlm_path)
    while pipe.scheduler.has_schedulable():
        pipe.run(pipe.plan())
    assert pipe.scheduler.num_admitted == 0


@pytest.fixture(scope="module")
def vlm_engine(vlm_path):
    with pipepool.Engine(str(vlm_path)) as engine:
        yield engine


@pytest.mark.parametrize(
    ("item", "says"),
    [
        ({"text": "x", "picture": 1}, "key 'picture' is not one of"),
        ({"image": sample_images()[0], "images": []}, "not both"),
        ({}, "neither text nor image"),
        ({"image": b"not an image"}, "not a decodable image"),
        ("a plain text", "takes dicts"),
        ({"text": "spelled <|image_pad|> out"}, "1 image placeholders for 0 images"),
    ],
)
def test_bad_inputs_are_refused_by_index(vlm_engine, item, says):
    good = {"text": "fine", "image": sample_images()[1]}
    with pytest.raises(InvalidInputError, match=rf"input 1: .*{says}"):
        vlm_engine.embed([good, item])
    assert vlm_engine.embed([good]).shape == (1, 64)  # the engine goes on serving


def test_a_call_of_several_slices_is_its_inputs_alone_and_a_late_refusal_cancels_it(
    vlm_engine,
):
    """Inputs enqueue in slices as they are prepared (api/vlm.SLICE_INPUTS): a call of several
    slices gives each input its own vector, in order; a bad input after slices were enqueued
    refuses the call by its index, and the engine goes on serving."""
    from pipepool.api.vlm import SLICE_INPUTS

    items = (_inputs() * (2 * SLICE_INPUTS))[: 2 * SLICE_INPUTS + 3]
    whole = vlm_engine.embed(items)
    alone = np.concatenate([vlm_engine.embed([item]) for item in _inputs()])
    for i, vector in enumerate(whole):
        assert cosine(vector, alone[i % len(_inputs())]) > 0.99999, i
    late = len(items) - 1
    with pytest.raises(InvalidInputError, match=rf"input {late}: .*not a decodable image"):
        vlm_engine.embed([*items[:late], {"image": b"not an image"}])
    np.testing.assert_allclose(vlm_engine.embed(items[:3]), whole[:3], rtol=1e-5, atol=1e-6)


def test_text_options_refused_with_images(vlm_engine):
    item = {"text": "x", "image": sample_images()[0]}
    for option, value in [("truncate_prompt_tokens", 4), ("prompt_name", "query")]:
        with pytest.raises(InvalidInputError, match=f"{option} applies to texts"):
            vlm_engine.embed([item], **{option: value})
    with pytest.raises(InvalidInputError, match="late_chunking"):
        vlm_engine.embed([item], late_chunking=True)


def test_token_budget_counts_placeholders(vlm_engine):
    """A server's request budget (``Engine.submit(budget=...)``) counts the images'
    placeholder tokens too, refusing the call before anything is enqueued."""
    from pipepool.intake.token_budget import TokenBudget, TokenBudgetError

    item = {"text": "x", "image": sample_images()[0]}
    tokens = len(vlm_engine.pool([item], pooling="all")[0])  # one vector per token
    with pytest.raises(TokenBudgetError):
        vlm_engine.submit([item, item], budget=TokenBudget(per_call=2 * tokens - 1))
    assert len(vlm_engine.submit([item], budget=TokenBudget(tokens)).result()) == 1


def test_text_model_refuses_dict_inputs():
    with pipepool.Engine() as engine, pytest.raises(InvalidInputError, match="no dict inputs"):
        engine.embed([{"text": "x"}])


@pytest.mark.parametrize(
    "architecture",
    ["Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeModel", "LlavaForConditionalGeneration"],
)
def test_other_vl_families_are_refused(vlm_path, tmp_path, architecture):
    folder = tmp_path / architecture
    shutil.copytree(vlm_path, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = [architecture]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"unknown architecture '{architecture}'"):
        pipepool.Engine(str(folder))


def test_vision_tower_runs_once_per_image(vlm_path, monkeypatch):
    """However many steps an image's placeholders span, the first stage encodes each input's
    images once."""
    from pipepool.models.qwen2_vl import Qwen2VLStage

    calls = []
    encode = Qwen2VLStage.encode_images

    def counted(self, images):
        calls.append(len(images))
        return encode(self, images)

    monkeypatch.setattr(Qwen2VLStage, "encode_images", counted)
    with pipepool.Engine(str(vlm_path), max_num_batched_tokens=BUDGET) as engine:
        engine.embed(_inputs())
    assert sorted(calls) == [1, 1, 2, 2]


def test_vision_block_in_bf16_is_transformers_bit_for_bit():
    """A vision block in bf16 on two images' patches: transformers' Qwen2VLVisionBlock's output
    bit for bit. Its attention runs as transformers calls SDPA (4-D, per image): a 3-D call per
    image took the CPU's math path, more precise than transformers' flash kernel, so the image
    rows' bf16 error was not transformers' own (docs/parity.md)."""
    import transformers
    from transformers.models.qwen2_vl import modeling_qwen2_vl as hf

    from pipepool.models.qwen2_vl_vision import VisionBlock, VisionConfig, vision_rotary

    config = transformers.Qwen2VLVisionConfig(
        depth=1, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=4
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    theirs = hf.Qwen2VLVisionBlock(config).eval()
    cfg = VisionConfig.from_hf(config.to_dict(), 64)
    ours = VisionBlock(cfg)
    weights = theirs.state_dict()
    renamed = {"attn.qkv": "qkv", "attn.proj": "proj", "mlp.fc1": "fc1", "mlp.fc2": "fc2"}
    for name, value in weights.items():
        module, _, kind = name.rpartition(".")
        ours.get_submodule(renamed.get(module, module)).get_parameter(kind).data.copy_(value)
    theirs, ours = theirs.bfloat16(), ours.bfloat16()
    grids = [(1, 6, 8), (1, 10, 14)]
    lens = [h * w for _, h, w in grids]
    cos, sin = vision_rotary(cfg, grids, "cpu")
    x = torch.randn(sum(lens), 32).bfloat16()
    with torch.no_grad():
        want = theirs(
            x, cu_seqlens=torch.tensor([0, lens[0], sum(lens)]),
            position_embeddings=(cos[:, 0], sin[:, 0]),
        )  # fmt: skip
        got = ours(x, cos, sin, lens)
    assert torch.equal(got, want)


@pytest.fixture(scope="module")
def colqwen2_path(vlm_path, model_dir) -> Path:
    return make_colqwen2(vlm_path, model_dir / "colqwen2")


@pytest.mark.parametrize("pp", [1, 2])
def test_colqwen2_matches_transformers(colqwen2_path, pp):
    """Token vectors of pages and queries (cosine per token, unit norms) and MaxSim (score,
    rerank) against ColQwen2ForRetrieval and score_retrieval, one query and one page at a
    time (score_retrieval pads a batch of pages with zero vectors, which a MaxSim can pick)."""
    model, processor = colqwen2_reference(colqwen2_path)
    pages = sample_images()[:4]
    queries = ["a cat", SENTENCES[2], "which page shows the chart"]
    with torch.no_grad():
        want_pages = [
            model(**processor.process_images(images=[p], return_tensors="pt")).embeddings[0]
            for p in pages
        ]
        want_queries = [
            model(**processor.process_queries(text=[q], return_tensors="pt")).embeddings[0]
            for q in queries
        ]
    want = np.array([[float(processor.score_retrieval([q], [p])[0, 0]) for p in want_pages]
                     for q in want_queries])  # fmt: skip
    with pipepool.Engine(
        str(colqwen2_path), pipeline_parallel_size=pp, max_num_batched_tokens=BUDGET
    ) as engine:
        got_pages = engine.embed_tokens([{"image": p} for p in pages], normalize=True)
        got_queries = engine.pool([{"text": q} for q in queries], pooling="all")
        plain = engine.embed_tokens(queries[:1] + pages[:1])  # the projection, unnormalised
        one_to_many = engine.score(queries[0], pages)
        pairwise = engine.score(queries[:3], pages[:3])
        ranked = engine.rerank(queries[1], pages, top_n=2)
    for got, expected in zip(got_pages + got_queries, want_pages + want_queries, strict=True):
        assert got.shape == tuple(expected.shape)
        assert float(cosine(got, expected.numpy()).min()) >= MIN_COSINE
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
    for got, expected in zip(plain, [want_queries[0], want_pages[0]], strict=True):
        assert float(cosine(got, expected.numpy()).min()) >= MIN_COSINE  # a text: a query
        assert float(np.abs(np.linalg.norm(got, axis=1) - 1).max()) > 1e-3
    np.testing.assert_allclose(one_to_many, want[0], atol=1e-4)
    np.testing.assert_allclose(pairwise, np.diag(want[:3, :3]), atol=1e-4)
    assert [r.index for r in ranked] == np.argsort(-want[1], kind="stable")[:2].tolist()
    np.testing.assert_allclose([r.relevance_score for r in ranked],
                               np.sort(want[1])[::-1][:2], atol=1e-4)  # fmt: skip


@pytest.fixture(scope="module")
def colqwen2_engine(colqwen2_path):
    with pipepool.Engine(str(colqwen2_path)) as engine:
        yield engine


def test_colqwen2_refusals(colqwen2_engine):
    engine, image = colqwen2_engine, sample_images()[0]
    with pytest.raises(InvalidInputError, match="input 0: ColQwen2 embeds a query"):
        engine.pool([{"text": "x", "image": image}], pooling="all")
    with pytest.raises(InvalidInputError, match="ColQwen2 gives one vector per token"):
        engine.pool([{"image": image}], pooling="mean")
    with pytest.raises(InvalidInputError, match="dimensions: ColQwen2's token vectors"):
        engine.pool([{"image": image}], pooling="all", dimensions=8)
    with pytest.raises(InvalidInputError, match=r"pages .* are images .*; input 1 is not"):
        engine.score("a query", [image, "a text page"])
    with pytest.raises(InvalidInputError, match="instruction does not apply"):
        engine.score("a query", [image], instruction="find it")
    with pytest.raises(InvalidInputError, match="return_documents does not apply"):
        engine.rerank("a query", [image], return_documents=True)


def test_text_spelling_the_image_token_beside_images(vlm_path):
    """A plain text that spells ``<|image_pad|>`` out is embedded as tokens (as transformers
    does without pixel values), also in a step it shares with an input with images: no
    divergence is claimed for it."""
    from pipepool.core.request import PoolingParams, RequestBatch

    pipe = SteppedPipeline(vlm_path, pp=2)
    image_token = json.loads((vlm_path / "config.json").read_text())["image_token_id"]
    text = np.array([7, 8, image_token, 9, 10, 11], dtype=np.int64)
    pipe.scheduler.add(RequestBatch(1000, text, np.array([len(text)]), PoolingParams("last")))
    _stepped_request(pipe, vlm_path)
    plan = pipe.plan()
    assert len(plan.media) and len(plan.req_ids) == 2  # the two share the first step
    pipe.run(plan)
    while pipe.scheduler.has_schedulable():
        pipe.run(pipe.plan())
    assert pipe.scheduler.num_admitted == 0


def test_instruction_as_a_system_message(vlm_engine, vlm_reference, colqwen2_engine):
    """Qwen2-VL renders a dict input's ``instruction`` as Qwen3-VL-Embedding's reference code
    does (a system message, in place of the template's default one): transformers' hidden state
    at the last token, cos >= 0.99999. A page retriever takes none."""
    items = instructed_inputs()
    want = reference_vectors(*vlm_reference, items)
    got = vlm_engine.embed(items, normalize=False)
    assert float(cosine(got, want).min()) >= MIN_COSINE
    with pytest.raises(InvalidInputError, match="input 0: 'instruction' is not taken by ColQwen2"):
        colqwen2_engine.embed([{"text": "q", "instruction": "Find"}])
