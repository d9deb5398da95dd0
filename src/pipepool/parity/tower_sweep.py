"""``pipepool parity`` on a dual encoder (CLIP, SigLIP, SigLIP2): texts through the text tower
and images through the vision tower, at every PP degree and token budget, each vector against
transformers' ``get_text_features`` / ``get_image_features`` on the same weights (or the engine
at PP 1 with one step per prompt), per request.

The texts are the prompts given (or the built-in set cut to the text tower's length); the
images the built-in ones (``prompts.builtin_images``: several sizes and modes). The reference
sees what the engine sees: the engine's token ids, and the images as the checkpoint's PIL
image processor prepares them after RGB conversion."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from ..api.engine import Engine
from ..config import EngineConfig
from ..core.dual_encoders import DUAL_ENCODERS
from ..intake.naflex_images import NaFlexProcessing
from ..loading.deployment import Deployment
from ..loading.st_dual_encoder import processor_config
from ..models.towers import TowerConfig
from .compare import Row, fill_row, score_request, within_allowed
from .prompts import builtin_images
from .reference import ReferenceOutputs, _require
from .report import ParityReport
from .settings import (
    Sweep,
    default_min_cosine,
    failed_row,
    precision_of,
    preview,
    prompt_ids,
    sixteen_bit_bar,
)

# transformers' PIL image processor of each kind (the one pipepool's preprocessing equals).
_PROCESSORS = {
    "clip": "CLIPImageProcessorPil",
    "siglip": "SiglipImageProcessorPil",
    "siglip2": "Siglip2ImageProcessorPil",
}
# The processor config's bookkeeping, which is not a constructor argument.
_BOOKKEEPING = ("image_processor_type", "processor_class", "feature_extractor_type")
# A row's "pooling" column names the tower.
TOWERS = ("text", "image")


def run_tower_parity(
    base: EngineConfig,
    deployment: Deployment,
    sweep: Sweep,
    prompts: Sequence | None,
    log: Callable[[str], None],
) -> ParityReport:
    texts, token_ids = prompt_ids(deployment, prompts)
    images = builtin_images()
    inputs = {"text": token_ids, "image": images}
    log(f"reference: {sweep.reference} on {len(texts)} texts and {len(images)} images")
    ref = _reference(sweep.reference, deployment, inputs, sweep.reference_device,
                     sweep.reference_dtype)  # fmt: skip
    threshold = sweep.min_cosine or default_min_cosine(deployment.dtype)
    allowed: dict[str, list[np.ndarray]] | None = None
    rule = None
    if sweep.min_cosine is None and sweep.uses_16bit_rule(deployment):
        engine_dtype = str(deployment.dtype).removeprefix("torch.")
        peer = _reference("transformers", deployment, inputs, sweep.reference_device,
                          engine_dtype)  # fmt: skip
        allowed, rule = sixteen_bit_bar(peer, ref, TOWERS, engine_dtype)
    rows = image_rows(deployment, images)
    report = ParityReport(
        model=str(deployment.folder.path),
        reference=ref.description,
        engine=f"pipepool, {precision_of(deployment)} on {deployment.devices[0].split(':')[0]}",
        min_cosine=threshold,
        prompt_tokens=[len(ids) for ids in token_ids] + rows,
        prompt_previews=[preview(t) for t in texts]
        + [_image_preview(i, n) for i, n in zip(images, rows, strict=True)],
        rule=rule,
    )
    lengths = {"text": [len(ids) for ids in token_ids], "image": rows}
    for pp in sweep.pps:
        for budget in sweep.budgets:
            log(f"pp={pp} tokens={budget}: texts, images")
            config = base.replace(pipeline_parallel_size=pp, max_num_batched_tokens=budget)
            for r in _run_config(config, inputs, lengths, ref.outputs, threshold, allowed):
                if r.pooling == "image" and r.worst_request is not None:
                    r.worst_request += len(texts)  # the report numbers texts, then images
                report.rows.append(r)
    return report


def _image_preview(image, rows: int) -> str:
    return f"<image {image.width}x{image.height} {image.mode}: {rows} patch rows>"


def image_rows(deployment: Deployment, images: list) -> list[int]:
    """The plan rows (positions) of each image in the vision tower: its patches, plus CLIP's
    class token; SigLIP2's depend on the image's aspect ratio."""
    hf, kind = deployment.folder.hf_config, DUAL_ENCODERS[deployment.folder.architecture]
    tower = TowerConfig.from_hf(hf, kind, "vision")
    if not tower.naflex:
        return [tower.max_positions] * len(images)
    processing = NaFlexProcessing.from_folder(
        deployment.folder.path, tower.patch_size, tower.max_positions
    )
    return [int(np.prod(processing.grid(i.height, i.width))) for i in images]


def _run_config(
    config: EngineConfig,
    inputs: dict[str, list],
    lengths: dict[str, list[int]],
    expected: dict[str, list[np.ndarray]],
    threshold: float,
    allowed: dict[str, list[np.ndarray]] | None,
) -> list[Row]:
    budget = config.max_num_batched_tokens
    assert budget is not None, "each configuration of a sweep names its token budget"

    def row(tower: str, chunked: int = 0) -> Row:
        return Row(pp=config.pipeline_parallel_size, max_num_batched_tokens=budget,
                   pooling=tower, requests=len(inputs[tower]), chunked=chunked)  # fmt: skip

    try:
        engine = Engine.from_config(config)
    except Exception as exc:  # e.g. more stages than layers
        return [failed_row(row(t), exc, 0.0) for t in TOWERS]
    rows = []
    with engine:
        for tower in TOWERS:
            t0 = time.perf_counter()
            chunked_before = engine.stats.chunked_requests
            try:
                got = list(engine.embed(inputs[tower], normalize=False))
                scores = [
                    score_request(i, g, e)
                    for i, (g, e) in enumerate(zip(got, expected[tower], strict=True))
                ]
            except Exception as exc:
                rows.append(failed_row(row(tower), exc, time.perf_counter() - t0))
                continue
            r = row(tower, engine.stats.chunked_requests - chunked_before)
            r.seconds = time.perf_counter() - t0
            r = fill_row(r, scores, lengths[tower], threshold)
            if allowed is not None:
                r.passed = all(
                    within_allowed(g, e, a)
                    for g, e, a in zip(got, expected[tower], allowed[tower], strict=True)
                )
            rows.append(r)
    return rows


def _reference(
    kind: str, deployment: Deployment, inputs: dict[str, list], device, dtype
) -> ReferenceOutputs:
    if kind == "pp1":
        longest = max(len(ids) for ids in inputs["text"])
        config = deployment.config.replace(
            pipeline_parallel_size=1, max_num_batched_tokens=max(longest, 8192)
        )
        with Engine.from_config(config) as engine:
            outputs = {t: list(engine.embed(inputs[t], normalize=False)) for t in TOWERS}
        return ReferenceOutputs("pipepool, PP=1, one step per prompt", outputs)
    return _transformers_reference(deployment, inputs, device, dtype)


def _transformers_reference(
    deployment: Deployment, inputs: dict[str, list], device, dtype
) -> ReferenceOutputs:
    import torch

    transformers = _require("transformers", "the transformers reference")
    folder, architecture = deployment.folder.path, deployment.folder.architecture
    kind = DUAL_ENCODERS[architecture]
    torch_dtype = getattr(torch, dtype) if dtype else deployment.dtype
    where = device or deployment.devices[0]
    model = getattr(transformers, architecture).from_pretrained(str(folder), dtype=torch_dtype)
    model = model.to(where).eval()
    _, settings = processor_config(folder)
    processor = getattr(transformers, _PROCESSORS[kind])(
        **{k: v for k, v in settings.items() if k not in _BOOKKEEPING}
    )

    def vector(output) -> np.ndarray:
        pooled = getattr(output, "pooler_output", output)
        return pooled[0].float().cpu().numpy()

    outputs: dict[str, list[np.ndarray]] = {"text": [], "image": []}
    with torch.no_grad():
        for ids in inputs["text"]:
            ids_t = torch.as_tensor(np.asarray(ids), device=where)[None]
            outputs["text"].append(vector(model.get_text_features(input_ids=ids_t)))
        for image in inputs["image"]:
            batch = processor(images=[image.convert("RGB")], return_tensors="pt")
            batch = {
                k: v.to(where, torch_dtype) if v.is_floating_point() else v.to(where)
                for k, v in batch.items()
            }
            outputs["image"].append(vector(model.get_image_features(**batch)))
    name = str(torch_dtype).removeprefix("torch.")
    description = (
        f"transformers {transformers.__version__} {architecture}.get_text_features / "
        f"get_image_features ({_PROCESSORS[kind]}), {name} on {where}"
    )
    return ReferenceOutputs(description, outputs)
