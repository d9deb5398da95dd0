"""SigLIP2's NaFlex image preprocessing: an image at its own aspect ratio, cut into at most
``max_num_patches`` patches, as the rows a vision plan carries (``models/tower_vision.py``).

Every image is converted to RGB first: transformers' processor leaves that to the caller
(``do_convert_rgb`` unset) and fails on other modes, since it normalises three channels.

transformers' ``Siglip2ImageProcessorPil`` resizes each image to the largest patch grid of its
aspect ratio that fits the patch budget (a bisection over the scale, each side rounded up to a
whole patch, at least one), rescales and normalises it, and lays each patch out as (row,
column, channel) values. The rows here are those values, then the grid's height and width, so
the vision tower can resize its position table to the image's grid. Refusals of untrusted
input (files, formats, pixel limits) happen before, in ``intake/images.py``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ModelLoadError
from ..loading.st_dual_encoder import checked_processor_config
from .images import ImageProcessing

_PROCESSORS = ("Siglip2ImageProcessor", "Siglip2ImageProcessorFast", "Siglip2ImageProcessorPil")
# preprocessor_config.json keys read below, and the processor's bookkeeping.
_READ = {
    "do_resize", "resample", "do_rescale", "rescale_factor", "do_normalize", "image_mean",
    "image_std", "do_convert_rgb", "patch_size", "max_num_patches",
}  # fmt: skip
_IGNORED = {"image_processor_type", "processor_class"}
# transformers' class defaults (Siglip2ImageProcessorPil's attributes).
_DEFAULTS = dict(
    resample=2, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
    image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), do_convert_rgb=None,
    patch_size=16, max_num_patches=256,
)  # fmt: skip
# The bisection over the resize scale: its bounds and the width at which it stops.
_SCALE_LOW, _SCALE_HIGH, _SCALE_EPS = 1e-6, 100.0, 1e-5


@dataclass(frozen=True)
class NaFlexProcessing:
    """What a SigLIP2 folder's image processor does: resize to ``grid(h, w)`` patches (PIL,
    ``resample``), then ``values`` (rescale and normalise, as CLIP's and SigLIP's processors
    do); ``rows(image)`` gives the plan rows of one decoded image."""

    patch_size: int
    max_num_patches: int
    resample: int
    values: ImageProcessing  # rescale / normalise / RGB; its resize and crop are off

    @classmethod
    def from_folder(cls, folder: Path, patch_size: int, max_positions: int) -> NaFlexProcessing:
        file, given = checked_processor_config(folder, _PROCESSORS, _READ, _IGNORED, "SigLIP2")
        if given.get("do_resize", True) is not True:
            raise ModelLoadError(
                f"{file}: do_resize={given['do_resize']!r}; SigLIP2's processor always fits an "
                "image to its patch budget"
            )
        values = {**_DEFAULTS, **{k: v for k, v in given.items() if k in _READ}}
        if int(values["patch_size"]) != patch_size:
            raise ModelLoadError(
                f"{file}: patch_size {values['patch_size']} but the vision tower's patches are "
                f"{patch_size} pixels"
            )
        budget = int(values["max_num_patches"])
        if not 1 <= budget <= max_positions:
            raise ModelLoadError(
                f"{file}: max_num_patches {budget}; the vision tower takes 1 to {max_positions} "
                "patches an image (its num_patches; a larger position table is not implemented)"
            )
        if values["do_convert_rgb"] is False:
            raise ModelLoadError(
                f"{file}: do_convert_rgb=false is not implemented (images are converted to RGB: "
                "the processor normalises three channels)"
            )
        pixel_values = ImageProcessing(
            do_resize=False, size={}, resample=int(values["resample"]), do_center_crop=False,
            crop_size=None, do_rescale=bool(values["do_rescale"]),
            rescale_factor=float(values["rescale_factor"]),
            do_normalize=bool(values["do_normalize"]),
            image_mean=tuple(values["image_mean"]), image_std=tuple(values["image_std"]),
            do_convert_rgb=True,
        )  # fmt: skip
        return cls(patch_size, budget, int(values["resample"]), pixel_values)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, columns) of patches an ``height x width`` image is resized to: the largest
        scale (by bisection) whose sides, each rounded up to whole patches, fit the budget."""
        low, high = _SCALE_LOW, _SCALE_HIGH
        while high - low >= _SCALE_EPS:
            middle = (low + high) / 2
            rows, columns = self._patches(middle, height), self._patches(middle, width)
            if rows * columns <= self.max_num_patches:
                low = middle
            else:
                high = middle
        return self._patches(low, height), self._patches(low, width)

    def _patches(self, scale: float, side: int) -> int:
        return max(1, math.ceil(side * scale / self.patch_size))

    def rows(self, image, width: int) -> np.ndarray:
        """One decoded PIL image -> [patches, width] int64: each patch's (row, column,
        channel) float32 values then the grid's height and width, two float32 to an int64."""
        if self.values.do_convert_rgb and image.mode != "RGB":
            image = image.convert("RGB")
        rows, columns = self.grid(image.height, image.width)
        p = self.patch_size
        image = image.resize((columns * p, rows * p), resample=self.resample)
        pixels = self.values.pixel_values(image)  # [C, H, W]
        c = pixels.shape[0]
        patches = pixels.reshape(c, rows, p, columns, p).transpose(1, 3, 2, 4, 0)
        patches = patches.reshape(rows * columns, p * p * c)
        out = np.zeros((rows * columns, 2 * width), dtype=np.float32)
        out[:, : patches.shape[1]] = patches
        out[:, patches.shape[1] : patches.shape[1] + 2] = (rows, columns)
        return out.view(np.int64)
