"""Dual encoders (CLIP, SigLIP) against transformers on the same weights (fp32 CPU): texts
through the text tower (CLIP's causal one chunked to a 16-token budget), images through the
vision tower, at PP=1 and PP=2 (stage processes); the image preprocessing against the
checkpoint's transformers image processor; and the refusals of untrusted image inputs."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import MIN_COSINE, SENTENCES, cosine, long_prompts
from tiny_towers import make_clip, make_siglip, png_bytes, png_header, sample_images

import pipepool
from pipepool.errors import InvalidInputError
from pipepool.intake.images import plain_inputs

BUDGET = 16


@pytest.fixture(scope="module")
def tower_paths(model_dir) -> dict[str, Path]:
    return {"clip": make_clip(model_dir / "clip"), "siglip": make_siglip(model_dir / "siglip")}


def _reference(kind: str, path: Path):
    import transformers

    model_cls = {"clip": transformers.CLIPModel, "siglip": transformers.SiglipModel}[kind]
    proc_cls = {
        "clip": transformers.CLIPImageProcessorPil,
        "siglip": transformers.SiglipImageProcessorPil,
    }[kind]
    return model_cls.from_pretrained(path).eval(), proc_cls.from_pretrained(path)


def _pooled(output) -> np.ndarray:
    """get_*_features' vectors (transformers 5 returns the output object with them pooled)."""
    return getattr(output, "pooler_output", output).numpy()


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_towers_match_transformers(tower_paths, kind, pp):
    path = tower_paths[kind]
    model, processor = _reference(kind, path)
    images = sample_images()
    texts = long_prompts()[:4] + SENTENCES[:3]
    with pipepool.Engine(
        str(path), pipeline_parallel_size=pp, max_num_batched_tokens=BUDGET
    ) as engine:
        text_vectors = engine.embed(texts, normalize=False)
        image_vectors = engine.embed(images, normalize=False)
        ids = engine.tokenize(texts)
    assert max(len(i) for i in ids) > BUDGET  # some texts span several steps
    with torch.no_grad():
        pixels = processor(images=images, return_tensors="pt")["pixel_values"]
        want_images = _pooled(model.get_image_features(pixel_values=pixels))
        want_texts = [
            _pooled(model.get_text_features(input_ids=torch.from_numpy(np.asarray(i))[None]))[0]
            for i in ids
        ]
    assert image_vectors.shape == want_images.shape
    worst_image = float(cosine(image_vectors, want_images).min())
    worst_text = float(cosine(text_vectors, np.stack(want_texts)).min())
    assert worst_image >= MIN_COSINE, f"{kind} PP={pp} images: cosine {worst_image}"
    assert worst_text >= MIN_COSINE, f"{kind} PP={pp} texts: cosine {worst_text}"


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_pixel_values_equal_transformers_processor(tower_paths, kind):
    """The engine's preprocessing gives exactly the processor's pixel_values (RGBA, L and P
    modes, portrait and landscape, an image smaller than the crop)."""
    from pipepool.api.images import VisionTower  # noqa: F401 (the module the engine uses)
    from pipepool.intake.images import ImageProcessing

    path = tower_paths[kind]
    _, processor = _reference(kind, path)
    processing = ImageProcessing.from_folder(path, kind, 32)
    for image in sample_images():
        want = processor(images=[image], return_tensors="np")["pixel_values"][0]
        got = processing.pixel_values(image)
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


@pytest.fixture(scope="module")
def clip_engine(tower_paths, tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    (folder / "cat.png").write_bytes(png_bytes(sample_images()[0]))
    with pipepool.Engine(str(tower_paths["clip"]), allowed_local_media_path=str(folder)) as engine:
        yield engine, folder


def test_image_forms_agree(clip_engine):
    """A PIL image, its PNG bytes and a file under the allowed folder give the same vector."""
    engine, folder = clip_engine
    image = sample_images()[0]
    vectors = engine.embed([image, png_bytes(image), folder / "cat.png"])
    assert float(cosine(vectors, vectors[[0, 0, 0]]).min()) >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)  # normalised


@pytest.mark.parametrize(
    ("item", "says"),
    [
        (b"not an image at all", "not a decodable image"),
        (png_header(30_000, 30_000), "over the limit"),
        (Path("/etc/hostname"), "outside the allowed folder"),
    ],
)
def test_bad_images_are_refused_by_index(clip_engine, item, says):
    engine, _ = clip_engine
    good = sample_images()[1]
    start = time.monotonic()
    with pytest.raises(InvalidInputError, match=rf"input 1: .*{says}"):
        engine.embed([good, item])
    assert time.monotonic() - start < 1.0
    assert engine.embed([good]).shape == (1, 24)  # the engine goes on serving


def test_image_call_refusals(clip_engine):
    engine, _ = clip_engine
    image = sample_images()[0]
    with pytest.raises(InvalidInputError, match="input 1: a call embeds images or texts"):
        engine.embed([image, "a text"])
    for option, value in [("truncate_prompt_tokens", 4), ("prompt_name", "query")]:
        with pytest.raises(InvalidInputError, match=f"{option} applies to texts"):
            engine.embed([image], **{option: value})
    with pytest.raises(InvalidInputError, match="images pool as the vision tower does"):
        engine.pool([image], pooling="mean")
    with pytest.raises(InvalidInputError, match="late_chunking"):
        engine.embed([image], late_chunking=True)


def test_a_text_among_images_is_still_told_apart(clip_engine):
    # Texts or token ids alone skip the look at each input (``plain_inputs``); any other item
    # brings it back.
    engine, _ = clip_engine
    image = sample_images()[0]
    ids = np.array([5, 6])
    for call in ("a", ["a", "b"], ("a",), [[1, 2]], [ids, ids], ids, [np.int64(5), 6], []):
        assert plain_inputs(call)
    for call in (["a", image], image, [{"text": "a"}], {"text": "a"}, [Path("x.png")], [b"x"]):
        assert not plain_inputs(call)
    with pytest.raises(InvalidInputError, match="input 0: a call embeds images or texts"):
        engine.embed(["a text", image])
    texts = engine.embed(["a photo of a cat", "a dog"])
    assert np.array_equal(texts, engine.embed(("a photo of a cat", "a dog")))


def test_texts_and_token_ids_skip_the_look_at_each_input(clip_engine, monkeypatch):
    engine, _ = clip_engine
    ids = engine.tokenize(["a photo of a cat", "a dog"])
    expected = engine.embed(ids)

    def looked(*_):
        raise AssertionError("an input looked at one by one")

    monkeypatch.setattr(pipepool.intake.images, "is_image_input", looked)
    monkeypatch.setattr(pipepool.api.engine, "is_multimodal_call", looked)
    assert np.array_equal(engine.embed(ids), expected)
    assert np.array_equal(engine.embed([list(map(int, a)) for a in ids]), expected)
    assert np.array_equal(engine.embed(["a photo of a cat", "a dog"]), expected)


def test_local_files_refused_without_a_folder(tower_paths):
    refused = pytest.raises(InvalidInputError, match="input 0: local image files are refused")
    with pipepool.Engine(str(tower_paths["siglip"])) as engine, refused:
        engine.embed([Path("/tmp/x.png")])


def test_text_model_refuses_images():
    refused = pytest.raises(InvalidInputError, match="embeds text only")
    with pipepool.Engine() as engine, refused:  # the bundled all-MiniLM-L6-v2
        engine.embed([sample_images()[0]])


def test_clip_text_must_end_with_its_pooled_eos(clip_engine):
    """transformers pools CLIP's first EOS; pipepool pools the last token: an input where they
    differ is refused, naming it (a text spelling the EOS out, token ids without it)."""
    engine, _ = clip_engine
    ids = [int(t) for t in engine.tokenize(["a photo of a cat"])[0]]
    with pytest.raises(InvalidInputError, match="input 1: CLIP pools its EOS token"):
        engine.embed([ids, ids[:-1]])
    with pytest.raises(InvalidInputError, match="input 0: CLIP pools its EOS token"):
        engine.embed(["a cat <|endoftext|> and a dog"])
    assert engine.embed([ids]).shape == (1, 24)


def test_sentence_transformers_folder(tower_paths, model_dir):
    """sentence-transformers 6's save of a CLIP model (one multimodal Transformer module): the
    same vectors as its ``encode`` for texts and images, unnormalised as it leaves them."""
    from sentence_transformers import SentenceTransformer
    from tiny_towers import make_clip_st

    path = make_clip_st(tower_paths["clip"], model_dir / "clip-st")
    texts = SENTENCES[:4]
    with pipepool.Engine(str(path)) as engine:
        got_texts, got_images = engine.embed(texts), engine.embed(sample_images())
    model = SentenceTransformer(str(path), device="cpu")
    want_texts, want_images = model.encode(texts), model.encode(sample_images())
    for got, want in ((got_texts, want_texts), (got_images, want_images)):
        assert float(cosine(got, want).min()) >= MIN_COSINE
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1),
                                   rtol=1e-5)  # fmt: skip


def test_sentence_transformers_folder_refusals(tower_paths, model_dir):
    import json
    import shutil

    from tiny_towers import make_clip_st

    from pipepool.errors import ModelLoadError

    path = make_clip_st(tower_paths["clip"], model_dir / "clip-st-audio")
    config_file = path / "sentence_bert_config.json"
    config = json.loads(config_file.read_text())
    config["modality_config"]["audio"] = {"method": "forward", "method_output_name": "x"}
    config_file.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"modality_config\['audio'\]"):
        pipepool.Engine(str(path))
    shutil.rmtree(path)


@pytest.mark.parametrize(("option", "value"), [("compile", True), ("pooling", "mean")])
def test_engine_options_the_towers_do_not_honour(tower_paths, option, value):
    with pytest.raises(InvalidInputError) as refused:
        pipepool.Engine(str(tower_paths["clip"]), **{option: value})
    assert refused.value.param == option


def test_encode_takes_images_as_sentence_transformers_6_does(tower_paths):
    """``encode`` of a transformers CLIP folder: what sentence-transformers 6 builds for it (the
    towers' features, unnormalised), for a list of images and a single one."""
    from sentence_transformers import SentenceTransformer

    path = tower_paths["clip"]
    images = sample_images()
    model = SentenceTransformer(str(path), device="cpu")
    with pipepool.SentenceTransformer(str(path)) as adapter:
        got, one = adapter.encode(images), adapter.encode(images[0])
        texts = adapter.encode(SENTENCES[:2])
    want = model.encode(images)
    assert float(cosine(got, want).min()) >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1),
                               rtol=1e-5)  # fmt: skip
    assert one.shape == (24,) and float(cosine(one, want[0]).min()) >= MIN_COSINE
    assert float(cosine(texts, model.encode(SENTENCES[:2])).min()) >= MIN_COSINE
