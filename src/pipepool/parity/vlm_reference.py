"""The transformers reference of a vision-language parity run (``vlm_sweep.py``): the folder's
``Qwen2VLModel`` / ``Qwen2_5_VLModel`` / ``Qwen3VLModel`` (``AutoModel``) at every token, or
``ColQwen2ForRetrieval`` / ``ColPaliForRetrieval``'s token vectors and their processor's
``score_retrieval``, each input alone, on the processor's outputs.

The processor is transformers' own, built from the folder's parts with the PIL image processor
(the one pipepool's preprocessing equals) and no video processor (no input here is a video, and
transformers' needs torchvision). Before the model runs, each input's token ids (and Qwen's
pixel values and grids) are checked equal to what the engine enqueues for it: the reference
sees exactly what the engine sees, or the run stops naming the input."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..loading.deployment import Deployment
from ..models import family_of
from .reference import ParityError, ReferenceOutputs, _dtype_name, _release, _require, pool

# Families whose processor class transformers names per model type (Qwen's take a chat template).
_QWEN_PROCESSORS = {
    "qwen2_vl": "Qwen2VLProcessor",
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "qwen3_vl": "Qwen3VLProcessor",
}
_RETRIEVERS = {
    "colqwen2": ("ColQwen2ForRetrieval", "ColQwen2Processor", "Qwen2VLImageProcessorPil"),
    "colpali": ("ColPaliForRetrieval", "ColPaliProcessor", "SiglipImageProcessorPil"),
}


@dataclass(frozen=True)
class EnginePrompt:
    """What the engine enqueues for one dict input: its token ids and its images' pixel values
    and grids (``intake``'s ``VlmPrompt``, reduced to what the processor also gives)."""

    token_ids: np.ndarray
    pixels: list[np.ndarray]
    grids: list[tuple[int, int, int]]


def vlm_reference(
    deployment: Deployment,
    groups: dict[str, list],
    engine_prompts: dict[str, list[EnginePrompt | None]],
    poolings: tuple[str, ...],
    device: str,
    dtype,
) -> ReferenceOutputs:
    """Outputs per ``"{group} {pooling}"`` key (page retrievers: per group, their token vectors,
    and ``"maxsim"``: every query against every page, row-major), one input at a time. Text
    groups of token ids (``engine_prompts`` None) go to the decoder as they are."""
    transformers = _require("transformers", "the transformers reference")
    import torch

    family = family_of(deployment.folder.architecture).name
    path = str(deployment.folder.path)
    retriever = _RETRIEVERS.get(family)
    if retriever is not None:
        model = getattr(transformers, retriever[0]).from_pretrained(path, dtype=dtype)
        name = retriever[0]
    else:
        model = transformers.AutoModel.from_pretrained(path, dtype=dtype)
        name = type(model).__name__
    model = model.to(device).eval()
    processor = _processor(transformers, deployment, family)
    outputs: dict[str, list[np.ndarray]] = {}
    tokens: dict[str, list] = {}  # a retriever's token vectors, as tensors for score_retrieval
    try:
        with torch.inference_mode():
            for group, items in groups.items():
                for i, (item, seen) in enumerate(zip(items, engine_prompts[group], strict=True)):
                    if seen is None:  # token ids: the engine's own, straight to the decoder
                        batch = {"input_ids": torch.as_tensor(np.asarray(item))[None]}
                    else:
                        batch = _processed(processor, family, item)
                        _check_same(batch, seen, f"{group} input {i}")
                    out = model(**_to(batch, device, dtype))
                    if retriever is not None:
                        tokens.setdefault(group, []).append(out.embeddings[0].float())
                        continue
                    hidden = out.last_hidden_state[0].float().cpu().numpy()
                    for p in poolings:
                        outputs.setdefault(f"{group} {p}", []).append(pool(hidden, p))
        if retriever is not None and {"query", "page"} <= set(tokens):
            outputs["maxsim"] = [
                np.array([float(processor.score_retrieval([q], [p])[0, 0])])
                for q in tokens["query"] for p in tokens["page"]
            ]  # fmt: skip
            for group in groups:
                outputs[group] = [t.cpu().numpy() for t in tokens[group]]
    finally:
        del model
        _release(device)
    description = (
        f"transformers {transformers.__version__} {name} "
        f"({getattr(processor, 'reference_name', type(processor).__name__)}), "
        f"{_dtype_name(dtype)} on {device}"
    )
    return ReferenceOutputs(description, outputs)


def _processor(transformers, deployment: Deployment, family: str):
    folder = deployment.folder.path
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    if family in _RETRIEVERS:
        _, processor_cls, image_cls = _RETRIEVERS[family]
        image_processor = getattr(transformers, image_cls).from_pretrained(str(folder))
        return getattr(transformers, processor_cls)(
            image_processor=image_processor, tokenizer=tokenizer
        )
    from ..intake.chat_templates import chat_template

    base = getattr(transformers, _QWEN_PROCESSORS[family])

    class ImagesOnly(base):  # type: ignore[misc, valid-type]
        """The processor without its video processor (which needs torchvision)."""

        reference_name = f"{base.__name__} without videos"

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImagesOnly(
        image_processor=transformers.Qwen2VLImageProcessorPil.from_pretrained(str(folder)),
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=chat_template(folder),
    )


def _processed(processor, family: str, item: dict) -> dict[str, Any]:
    """The processor's tensors for one dict input, formatted as the engine formats it (one user
    message of its images, then its text, with the generation prompt; ColQwen2 / ColPali: a
    query or a page)."""
    images = [_pil(i) for i in item.get("images", [item["image"]] if "image" in item else [])]
    if family in _RETRIEVERS:
        if images:
            return dict(processor.process_images(images=images, return_tensors="pt"))
        return dict(processor.process_queries(text=[item["text"]], return_tensors="pt"))
    content: list[dict] = [{"type": "image"}] * len(images)
    if item.get("text"):
        content.append({"type": "text", "text": item["text"]})
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return dict(processor(text=[text], images=images or None, return_tensors="pt"))


def _check_same(batch: dict, seen: EnginePrompt, what: str) -> None:
    ids = batch["input_ids"][0].numpy()
    if not np.array_equal(ids, seen.token_ids):
        raise ParityError(
            f"{what}: the processor makes {len(ids)} token ids, the engine enqueues "
            f"{len(seen.token_ids)} different ones: the reference would not see what the engine "
            "sees"
        )
    if "image_grid_thw" in batch and seen.pixels:  # Qwen's patches, in the processor's layout
        grids = [tuple(g) for g in batch["image_grid_thw"].tolist()]
        pixels = batch["pixel_values"].float().numpy()  # ColQwen2's: [1, patches, values]
        pixels = pixels.reshape(-1, pixels.shape[-1])
        if grids != [tuple(g) for g in seen.grids] or not np.array_equal(
            pixels, np.concatenate(seen.pixels)
        ):
            raise ParityError(
                f"{what}: the processor's pixel values or grids differ from the engine's"
            )


def _to(batch: dict, device: str, dtype) -> dict:
    return {
        k: v.to(device, dtype) if v.is_floating_point() else v.to(device)
        for k, v in batch.items()
        if hasattr(v, "to")
    }


def _pil(image):
    from PIL import Image

    return Image.open(io.BytesIO(image)) if isinstance(image, bytes) else image
