"""Images in, vectors out: the vision tower of a dual encoder (CLIP, SigLIP, SigLIP2) beside
the text engine.

A dual-encoder checkpoint runs as two pipelines of the same shape (stages, devices, budget):
the engine's own, which is the text tower, and the vision tower's, opened here with
``tower="vision"``. ``Engine.embed`` sends a call of images here (one modality per call).
Images are decoded and preprocessed on the calling thread's pool of workers (PIL releases the
GIL while it decodes and resizes), then enqueued as one batch of patch rows: the vision
pipeline schedules, checks and pools them exactly as it does token prompts."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..config import EngineConfig
from ..core.dual_encoders import DUAL_ENCODERS
from ..core.priority import current_client, is_background
from ..core.request import PoolingParams
from ..core.submission import Submission
from ..driver.pipeline import Pipeline
from ..errors import InvalidInputError, ModelLoadError
from ..intake.images import ImageLimits, ImageProcessing, decode_image, patch_rows
from ..intake.inputs import InputPreparer, TokenSlice
from ..intake.naflex_images import NaFlexProcessing
from ..loading.deployment import Deployment
from ..models.tower_vision import patch_row_width
from ..models.towers import TowerConfig

# Images decoded at once per call (PIL's decoders and resize release the GIL).
_DECODE_THREADS = 4


class VisionTower:
    """The vision tower's pipeline and its image preprocessing. ``submit(images, params)``
    decodes (refusing bad inputs by index, before anything is enqueued), preprocesses and
    enqueues; returns the call's future, ``[n, D]`` float32 in input order."""

    def __init__(
        self, config: EngineConfig, text: Deployment, open_pipeline: Callable[..., Pipeline]
    ) -> None:
        self.pipeline: Pipeline = open_pipeline(config.replace(tower="vision"))
        try:
            d = self.pipeline.deployment
            kind = text.folder.architecture
            self.tower = TowerConfig.from_hf(text.folder.hf_config, _kind(kind), "vision")
            if d.output_dim != text.output_dim:
                raise ModelLoadError(
                    f"{kind}: the vision tower's vectors have {d.output_dim} components, the "
                    f"text tower's {text.output_dim}; they do not share one space"
                )
            self.processing: ImageProcessing | NaFlexProcessing = (
                NaFlexProcessing.from_folder(
                    text.folder.path, self.tower.patch_size, self.tower.max_positions
                )
                if self.tower.naflex
                else ImageProcessing.from_folder(
                    text.folder.path, _kind(kind), self.tower.image_size
                )
            )
        except BaseException:
            self.pipeline.close()
            raise
        folder = config.allowed_local_media_path
        self.limits = ImageLimits(Path(folder) if folder else None, config.max_image_pixels)
        self._pool = ThreadPoolExecutor(_DECODE_THREADS, thread_name_prefix="pipepool-images")

    @property
    def deployment(self) -> Deployment:
        return self.pipeline.deployment

    def plan_rows(self, images: list) -> list[np.ndarray]:
        """Each image decoded (refused by index where it must be), preprocessed as the
        checkpoint's transformers image processor does, and laid out as its plan rows."""
        decoded = list(self._pool.map(decode_image, images, range(len(images)),
                                      [self.limits] * len(images)))  # fmt: skip
        return list(self._pool.map(self._rows, decoded))

    def _rows(self, image) -> np.ndarray:
        tower, width = self.tower, patch_row_width(self.tower)
        if isinstance(self.processing, NaFlexProcessing):
            return self.processing.rows(image, width)
        pixels = self.processing.pixel_values(image)
        return patch_rows(pixels, tower.patch_size, width, tower.class_token)

    def submit(self, images: list, params: PoolingParams) -> Submission:
        if params.pooling != self.deployment.pooling:
            raise InvalidInputError(
                f"images pool as the vision tower does ({self.deployment.pooling}); pooling "
                f"{params.pooling!r} cannot be asked for",
                param="pooling",
            )
        rows = self.plan_rows(images)
        submission = Submission(
            params, len(images), params.dimensions or self.deployment.output_dim,
            on_cancel=self.pipeline.cancel, background=is_background(), client=current_client(),
        )  # fmt: skip
        if not images:
            return submission
        lengths = np.array([len(r) for r in rows], dtype=np.int64)
        try:
            self.pipeline.enqueue(submission, TokenSlice(0, np.concatenate(rows), lengths))
        except BaseException:
            submission.cancel()
            raise
        return submission

    def close(self) -> None:
        self.pipeline.close()
        self._pool.shutdown(wait=False)


def _kind(architecture: str) -> str:
    return DUAL_ENCODERS[architecture]


def open_vision_tower(
    config: EngineConfig, text: Deployment, open_pipeline: Callable[..., Pipeline]
) -> VisionTower | None:
    """The vision tower of a dual-encoder checkpoint, its pipeline opened by
    ``open_pipeline(config)`` as the engine opens its own (None for every other model)."""
    if text.folder.architecture not in DUAL_ENCODERS:
        return None
    return VisionTower(config, text, open_pipeline)


def submit_images(
    vision: VisionTower | None,
    inputs: InputPreparer,
    images: list,
    *,
    pooling: str | None,
    dimensions: int | None,
    normalize: bool | None,
    truncate_prompt_tokens: int | None,
    truncation_side: str,
    prompt_name: str | None,
    long_inputs: str | None,
) -> Submission:
    """``Engine.submit`` for a call of images: the text options have no meaning for an image
    and are refused by name; ``dimensions`` and ``normalize`` as for texts."""
    if vision is None:
        d = inputs.deployment
        if d.folder.architecture in DUAL_ENCODERS:  # Engine.from_config(config, pipeline)
            raise InvalidInputError(
                "this engine was given the text tower's pipeline only (Engine.from_config with "
                "a pipeline and no vision_pipeline); image inputs need the vision tower's too",
                param="input",
            )
        raise InvalidInputError(
            f"this model ({d.folder.architecture}) embeds text only; image inputs need a dual "
            "encoder (CLIPModel, SiglipModel, Siglip2Model)",
            param="input",
        )
    refuse_text_options(
        "images",
        truncate_prompt_tokens=truncate_prompt_tokens,
        truncation_side=truncation_side,
        prompt_name=prompt_name,
        long_inputs=long_inputs,
    )
    params = inputs.params(pooling or vision.deployment.pooling, dimensions, normalize)
    return vision.submit(images, params)


def refuse_text_options(
    what: str,
    *,
    truncate_prompt_tokens: int | None,
    truncation_side: str,
    prompt_name: str | None,
    long_inputs: str | None,
) -> None:
    """Refuse by name ``Engine.submit``'s options that apply to texts only, given for a call
    of ``what`` (images, inputs with images)."""
    given = {
        "truncate_prompt_tokens": truncate_prompt_tokens is not None,
        "truncation_side": truncation_side != "right",
        "prompt_name": prompt_name is not None,
        "long_inputs": long_inputs is not None,
    }
    for name, set_ in given.items():
        if set_:
            raise InvalidInputError(f"{name} applies to texts, not to {what}", param=name)
