"""Parity of a dual encoder (CLIP, SigLIP): each tower's vectors against the reference, per
input, at every (PP degree, token budget): texts through the text tower (CLIP's causal one
chunked by small budgets), images through the vision tower.

The reference is transformers' ``get_text_features`` on the engine's own token ids and
``get_image_features`` on the checkpoint's image processor's ``pixel_values`` (one input at a
time, unnormalised, as the engine with ``normalize=False``), or the engine itself with one stage
and whole prompts (``pp1``). The prompts: the texts given (or the built-in set) and a built-in
set of images of several sizes and modes."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from ..api.engine import Engine
from ..config import EngineConfig
from ..core.dual_encoders import DUAL_ENCODERS
from ..errors import InvalidInputError
from ..loading.deployment import Deployment
from ..models.towers import TowerConfig
from .compare import Row, allowed_error, fill_row, score_request, within_allowed
from .reference import ParityError, _dtype_name, _release, _require
from .report import ParityReport

# The towers as a report's rows name them (the column that names a pooling for other models).
TOWERS = ("text", "image")
# The built-in images: (height, width, mode), portrait, landscape, tiny, palette, alpha.
_IMAGES = [(224, 160, "RGB"), (97, 300, "RGBA"), (64, 64, "L"), (20, 25, "RGB"), (480, 360, "P")]


def builtin_images() -> list:
    """PIL images of random pixels (a fixed seed) in several sizes and modes."""
    from PIL import Image

    rng = np.random.default_rng(0)
    images = []
    for h, w, mode in _IMAGES:
        channels = {"RGB": 3, "RGBA": 4}.get(mode, 1)
        pixels = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
        image = Image.fromarray(pixels[..., 0] if channels == 1 else pixels)
        images.append(image.convert("P") if mode == "P" else image)
    return images


def run_dual_encoder_parity(
    base: EngineConfig,
    deployment: Deployment,
    sweep,
    texts: list,
    token_ids: list[np.ndarray],
    threshold: float,
    log: Callable[[str], None],
) -> ParityReport:
    """The parity report of a dual encoder: rows "text" and "image" per configuration of
    ``sweep`` (its poolings do not apply: each tower pools as the checkpoint says)."""
    images = builtin_images()
    refs = _reference(sweep.reference, deployment, token_ids, images, sweep.reference_device,
                      sweep.reference_dtype, base)  # fmt: skip
    description, expected = refs
    rule, allowed = None, None
    if sweep.min_cosine is None and sweep.uses_16bit_rule(deployment):
        engine_dtype = _dtype_name(deployment.dtype)
        log(f"reference: transformers in {engine_dtype} too, for docs/design.md §3's bar")
        _, peer = _reference("transformers", deployment, token_ids, images,
                             sweep.reference_device, engine_dtype, base)  # fmt: skip
        allowed = {
            t: [allowed_error(a, b) for a, b in zip(peer[t], expected[t], strict=True)]
            for t in TOWERS
        }
        rule = (
            f"1 - cos(engine, reference) <= 1.5 x (1 - cos(transformers {engine_dtype}, "
            "reference)) + 1e-5 for every input"
        )
    lengths = [len(ids) for ids in token_ids]
    folder = deployment.folder
    tower = TowerConfig.from_hf(folder.hf_config, DUAL_ENCODERS[folder.architecture], "vision")
    image_rows = (tower.image_size // tower.patch_size) ** 2 + tower.class_token
    report = ParityReport(
        model=str(deployment.folder.path),
        reference=description,
        engine=f"pipepool, {_dtype_name(deployment.dtype)} on "
        f"{deployment.devices[0].split(':')[0]}",
        min_cosine=threshold,
        prompt_tokens=lengths + [image_rows] * len(images),
        prompt_previews=[t if len(t) <= 48 else t[:45] + "..." for t in texts]
        + [f"<image {i.width}x{i.height} {i.mode}>" for i in images],
        rule=rule,
    )
    for pp in sweep.pps:
        for budget in sweep.budgets:
            log(f"pp={pp} tokens={budget}: text and image towers")
            config = base.replace(pipeline_parallel_size=pp, max_num_batched_tokens=budget)
            rows = _run_config(config, token_ids, images, image_rows, expected, threshold, allowed)
            for row in rows:
                if row.pooling == "image" and row.worst_request is not None:
                    row.worst_request += len(texts)  # an index into the report's prompts
            report.rows += rows
    return report


def check_sweep(deployment: Deployment, poolings: Sequence[str], defaults: Sequence[str]) -> None:
    """Refuse poolings asked of a dual encoder: its towers pool as the checkpoint says."""
    if tuple(poolings) != tuple(defaults):
        raise InvalidInputError(
            f"--pooling does not apply to {deployment.folder.architecture}: each tower pools as "
            "the checkpoint says (its rows are 'text' and 'image'); leave --pooling out",
            param="pooling",
        )


def _run_config(
    config: EngineConfig,
    token_ids: list[np.ndarray],
    images: list,
    image_rows: int,
    expected: dict[str, list[np.ndarray]],
    threshold: float,
    allowed: dict[str, list[np.ndarray]] | None,
) -> list[Row]:
    budget = config.max_num_batched_tokens
    assert budget is not None, "each configuration of a sweep names its token budget"
    inputs = {"text": [ids.tolist() for ids in token_ids], "image": images}

    def row(tower: str, chunked: int = 0) -> Row:
        return Row(pp=config.pipeline_parallel_size, max_num_batched_tokens=budget,
                   pooling=tower, requests=len(inputs[tower]), chunked=chunked)  # fmt: skip

    try:
        engine = Engine.from_config(config)
    except Exception as exc:  # e.g. more stages than layers
        return [_failed(row(t), exc, 0.0) for t in TOWERS]
    rows = []
    with engine:
        for tower in TOWERS:
            t0 = time.perf_counter()
            chunked_before = engine.stats.chunked_requests
            try:
                got = engine.embed(inputs[tower], normalize=False)
                scores = [
                    score_request(i, g, e)
                    for i, (g, e) in enumerate(zip(got, expected[tower], strict=True))
                ]
            except Exception as exc:
                rows.append(_failed(row(tower), exc, time.perf_counter() - t0))
                continue
            r = row(tower, engine.stats.chunked_requests - chunked_before)
            r.seconds = time.perf_counter() - t0
            lengths = [len(t) for t in token_ids] if tower == "text" else [image_rows] * len(images)
            r = fill_row(r, scores, lengths, threshold)
            if allowed is not None:
                r.passed = all(
                    within_allowed(g, e, a)
                    for g, e, a in zip(got, expected[tower], allowed[tower], strict=True)
                )
            rows.append(r)
    return rows


def _failed(row: Row, exc: BaseException, seconds: float) -> Row:
    row.error = f"{type(exc).__name__}: {exc}"
    row.seconds = seconds
    return row


def _reference(
    kind: str,
    deployment: Deployment,
    token_ids: list[np.ndarray],
    images: list,
    device: str | None,
    dtype: str | None,
    base: EngineConfig,
) -> tuple[str, dict[str, list[np.ndarray]]]:
    """(what it is, in words; tower -> one vector per input)."""
    if kind == "pp1":
        config = replace(base, pipeline_parallel_size=1, max_num_batched_tokens=8192)
        with Engine.from_config(config) as engine:
            text = list(engine.embed([ids.tolist() for ids in token_ids], normalize=False))
            image = list(engine.embed(images, normalize=False))
        words = f"pipepool PP=1, whole prompts, {_dtype_name(deployment.dtype)}"
        return words, {"text": text, "image": image}
    if kind != "transformers":
        raise ParityError(f"unknown reference {kind!r}; choose transformers or pp1")
    import torch

    transformers = _require("transformers", "the reference")
    where = device or deployment.devices[0]
    torch_dtype = getattr(torch, dtype) if dtype else deployment.dtype
    path = deployment.folder.path
    model = transformers.AutoModel.from_pretrained(path, dtype=torch_dtype).to(where).eval()
    # The PIL processor, which pipepool's preprocessing equals (the torchvision one resizes
    # differently: docs/images.md).
    kind = DUAL_ENCODERS[deployment.folder.architecture]
    processors = {"clip": "CLIPImageProcessorPil", "siglip": "SiglipImageProcessorPil"}
    processor = getattr(transformers, processors[kind]).from_pretrained(path)
    try:
        with torch.inference_mode():
            text = [
                _pooled(model.get_text_features(input_ids=torch.as_tensor(ids, device=where)[None]))
                for ids in token_ids
            ]
            image = []
            for item in images:
                pixels = processor(images=[item], return_tensors="pt")["pixel_values"]
                features = model.get_image_features(pixel_values=pixels.to(where, torch_dtype))
                image.append(_pooled(features))
    finally:
        del model
        _release(where)
    name = f"transformers {transformers.__version__} {type(processor).__name__} and "
    name += "get_text_features / get_image_features"
    return f"{name}, {_dtype_name(torch_dtype)} on {where}", {"text": text, "image": image}


def _pooled(output) -> np.ndarray:
    """One input's features (transformers 5 returns an output object with them pooled)."""
    tensor = getattr(output, "pooler_output", output)
    return tensor[0].float().cpu().numpy()
