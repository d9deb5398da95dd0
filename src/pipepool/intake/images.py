"""Image inputs of a dual encoder's vision tower: untrusted bytes to checked pixels to the patch
rows a vision plan carries (``models/tower_vision.py``).

Refusals come before any decoding: a file outside ``allowed_local_media_path``, a format other
than the common still-image ones, and an image whose header says more than
``max_image_pixels`` pixels (a decompression bomb's header is all it takes) each raise
``InvalidInputError`` naming the input. Preprocessing is transformers' PIL image processor
(``CLIPImageProcessorPil`` / ``SiglipImageProcessorPil``, as ``preprocessor_config.json``
configures it): RGB, resize with PIL, center crop, rescale, normalise, in the same order and
arithmetic, so ``pixel_values`` equals the processor's."""

from __future__ import annotations

import functools
import io
import math
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InvalidInputError, ModelLoadError
from ..loading.st_dual_encoder import checked_processor_config

# Still-image formats PIL may open for an input; every other decoder stays out of reach.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
# transformers' defaults per checkpoint kind (its PIL processors' class attributes).
_CLIP_MEAN, _CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
_DEFAULTS = {
    "clip": dict(
        size={"shortest_edge": 224}, resample=3, do_center_crop=True,
        crop_size={"height": 224, "width": 224}, image_mean=_CLIP_MEAN, image_std=_CLIP_STD,
    ),
    "siglip": dict(
        size={"height": 224, "width": 224}, resample=3, do_center_crop=False, crop_size=None,
        image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
    ),
}  # fmt: skip
_PROCESSORS = {
    "clip": ("CLIPImageProcessor", "CLIPImageProcessorFast", "CLIPImageProcessorPil"),
    "siglip": ("SiglipImageProcessor", "SiglipImageProcessorFast", "SiglipImageProcessorPil"),
}
# preprocessor_config.json keys read below; any other is refused unless it is bookkeeping.
_READ = {
    "do_resize", "size", "resample", "do_center_crop", "crop_size", "do_rescale",
    "rescale_factor", "do_normalize", "image_mean", "image_std", "do_convert_rgb",
}  # fmt: skip
# The processor's bookkeeping, which changes nothing it computes.
_IGNORED = {
    "image_processor_type",
    "processor_class",
    "feature_extractor_type",
    "default_to_square",
}


@dataclass(frozen=True)
class ImageProcessing:
    """What a checkpoint's image processor does to an image, read from its
    ``preprocessor_config.json`` (transformers' class defaults where a key is absent)."""

    do_resize: bool
    size: dict
    resample: int  # PIL's resampling filter code
    do_center_crop: bool
    crop_size: dict | None
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    do_convert_rgb: bool

    @classmethod
    def from_folder(
        cls, folder: Path, kind: str, image_size: int, *, read_elsewhere: frozenset = frozenset()
    ) -> ImageProcessing:
        """``read_elsewhere``: keys the caller reads itself (ColPali's ``image_seq_length``)."""
        file, given = checked_processor_config(
            folder, _PROCESSORS[kind], _READ, _IGNORED | read_elsewhere, kind
        )
        values = {**_DEFAULTS[kind], **{k: v for k, v in given.items() if k in _READ}}
        proc = cls(
            do_resize=bool(values.get("do_resize", True)),
            size=dict(values["size"]),
            resample=int(values["resample"]),
            do_center_crop=bool(values["do_center_crop"]),
            crop_size=dict(values["crop_size"]) if values.get("crop_size") else None,
            do_rescale=bool(values.get("do_rescale", True)),
            rescale_factor=float(values.get("rescale_factor", 1 / 255)),
            do_normalize=bool(values.get("do_normalize", True)),
            image_mean=tuple(values["image_mean"]),
            image_std=tuple(values["image_std"]),
            do_convert_rgb=bool(values.get("do_convert_rgb", True)),
        )
        out = proc.output_size()
        if out != (image_size, image_size):
            raise ModelLoadError(
                f"{file}: images come out {out or 'at their own sizes'}, the vision tower takes "
                f"{image_size}x{image_size} (position interpolation is not implemented)"
            )
        return proc

    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every processed image, where the config fixes it."""
        if self.do_center_crop and self.crop_size:
            return int(self.crop_size["height"]), int(self.crop_size["width"])
        if self.do_resize and "height" in self.size and "width" in self.size:
            return int(self.size["height"]), int(self.size["width"])
        return None

    def pixel_values(self, image) -> np.ndarray:
        """[C, H, W] float32, as transformers' PIL image processor computes them."""
        if self.do_convert_rgb and image.mode != "RGB":
            image = image.convert("RGB")
        if self.do_resize:
            height, width = self._resized(image.height, image.width)
            image = image.resize((width, height), resample=self.resample)
        array = np.array(image)
        if array.ndim == 2:
            array = array[:, :, None]
        array = array.transpose(2, 0, 1)  # channels first
        if self.do_center_crop and self.crop_size:
            array = _center_crop(array, int(self.crop_size["height"]), int(self.crop_size["width"]))
        scaling = (self.do_rescale, self.rescale_factor, self.do_normalize, self.image_mean,
                   self.image_std)  # fmt: skip
        if array.dtype == np.uint8:
            # Each of the 256 byte values through the arithmetic once, then looked up: the
            # same bits (every operation is elementwise IEEE arithmetic), one pass over the
            # pixels where the arithmetic takes five (10 ms against 150 for 1024x768 here).
            table = _byte_table(scaling, array.shape[0])
            if len(table) == array.shape[0]:
                return table[np.arange(len(table))[:, None, None], array]
        return _scaled(array, *scaling)

    def _resized(self, height: int, width: int) -> tuple[int, int]:
        size = self.size
        if "shortest_edge" in size:  # transformers' get_resize_output_image_size
            edge = int(size["shortest_edge"])
            short, long = (width, height) if width <= height else (height, width)
            new_long = int(edge * long / short)
            return (new_long, edge) if width <= height else (edge, new_long)
        return int(size["height"]), int(size["width"])


def _scaled(
    array: np.ndarray,
    do_rescale: bool,
    rescale_factor: float,
    do_normalize: bool,
    image_mean: tuple[float, ...],
    image_std: tuple[float, ...],
) -> np.ndarray:
    """[C, H, W] float32: rescaled and normalised in transformers' arithmetic (the rescale in
    float64, the normalisation in float32)."""
    if do_rescale:
        array = (array.astype(np.float64) * rescale_factor).astype(np.float32)
    if do_normalize:
        array = array.astype(np.float32, copy=False)
        mean = np.array(image_mean, dtype=array.dtype)[:, None, None]
        std = np.array(image_std, dtype=array.dtype)[:, None, None]
        array = (array - mean) / std
    return np.ascontiguousarray(array, dtype=np.float32)


@functools.lru_cache(maxsize=32)
def _byte_table(scaling: tuple, channels: int) -> np.ndarray:
    """[C, 256] float32: what :func:`_scaled` makes of each byte value in each channel."""
    values = np.broadcast_to(np.arange(256, dtype=np.uint8), (channels, 1, 256))
    table = _scaled(values, *scaling)[:, 0, :]
    table.setflags(write=False)  # shared by every call
    return table


def _center_crop(array: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' center_crop of a [C, H, W] array, zero padding where it is smaller."""
    h, w = array.shape[1:]
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return array[:, top : top + height, left : left + width]
    new_h, new_w = max(height, h), max(width, w)
    padded = np.zeros((array.shape[0], new_h, new_w), dtype=array.dtype)
    top_pad, left_pad = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
    padded[:, top_pad : top_pad + h, left_pad : left_pad + w] = array
    top, left = top + top_pad, left + left_pad
    return padded[
        :, max(0, top) : min(new_h, top + height), max(0, left) : min(new_w, left + width)
    ]


@dataclass(frozen=True)
class ImageLimits:
    """What an image input may be: files only under ``local_folder`` (None: no files), at most
    ``max_pixels`` pixels (width x height, read from the header before decoding)."""

    local_folder: Path | None
    max_pixels: int


def decode_image(item, index: int, limits: ImageLimits):
    """One input (a PIL image, bytes, or a ``pathlib.Path``) as a decoded PIL image; raises
    InvalidInputError naming input ``index`` for anything refused or undecodable."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(item, Image.Image):
        _check_pixels(item.width, item.height, index, limits)
        return item
    source: io.BytesIO | Path
    if isinstance(item, Path):
        source = _local_file(item, index, limits)  # PIL reads the header, then what it needs
    elif isinstance(item, (bytes, bytearray, memoryview)):
        source = io.BytesIO(item)
    else:
        raise InvalidInputError(
            f"input {index}: an image is a PIL image, bytes or a pathlib.Path, got "
            f"{type(item).__name__}",
            param="input",
            index=index,
        )
    try:
        with warnings.catch_warnings():  # our own limit decides, below PIL's refusal
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(source, formats=IMAGE_FORMATS)
            _check_pixels(image.width, image.height, index, limits)  # from the header alone
            image.load()
    except InvalidInputError:
        raise
    except Image.DecompressionBombError as exc:  # PIL's own bound, from the header too
        raise InvalidInputError(
            f"input {index}: the image is over the limit of {limits.max_pixels} pixels "
            f"(max_image_pixels), as its header says (PIL: {exc})",
            param="input",
            index=index,
        ) from None
    except Exception as exc:  # PIL raises many kinds for bad data: all are bad input
        # PIL's "cannot identify image file <_io.BytesIO object at 0x...>" names an address:
        # the same input would be refused in different words each time.
        why = (
            "its bytes are none of these formats"
            if isinstance(exc, UnidentifiedImageError)
            else f"{type(exc).__name__}: {exc}"
        )
        raise InvalidInputError(
            f"input {index}: not a decodable image ({', '.join(IMAGE_FORMATS)}): {why}",
            param="input",
            index=index,
        ) from None
    return image


def _check_pixels(width: int, height: int, index: int, limits: ImageLimits) -> None:
    if width < 1 or height < 1:
        raise InvalidInputError(
            f"input {index}: an empty image ({width}x{height})", param="input", index=index
        )
    if width * height > limits.max_pixels:
        raise InvalidInputError(
            f"input {index}: the image is {width}x{height} = {width * height} pixels, over the "
            f"limit of {limits.max_pixels} (max_image_pixels)",
            param="input",
            index=index,
        )


def _local_file(path: Path, index: int, limits: ImageLimits) -> Path:
    if limits.local_folder is None:
        raise InvalidInputError(
            f"input {index}: local image files are refused unless the engine allows a folder "
            "(allowed_local_media_path / --allowed-local-media-path)",
            param="input",
            index=index,
        )
    root = limits.local_folder.resolve()
    target = path.resolve()
    if not target.is_relative_to(root):
        raise InvalidInputError(
            f"input {index}: {path} is outside the allowed folder {root}",
            param="input",
            index=index,
        )
    if not target.is_file():
        raise InvalidInputError(f"input {index}: {path} is not a file", param="input", index=index)
    return target


def patch_rows(pixels: np.ndarray, patch: int, width: int, class_token: bool) -> np.ndarray:
    """[C, H, W] float32 -> [positions, width] int64: each patch's (C, p, p) values, two
    float32 to an int64, row-major over the patch grid; a zero row first for a class token."""
    c, h, w = pixels.shape
    grid = pixels.reshape(c, h // patch, patch, w // patch, patch).transpose(1, 3, 0, 2, 4)
    values = grid.reshape(-1, c * patch * patch)
    rows = np.zeros((len(values) + class_token, 2 * width), dtype=np.float32)
    rows[class_token:, : values.shape[1]] = values
    return rows.view(np.int64)


# Item types of a call of texts or token ids (numpy's integer scalars besides): no image, no
# dict, no conversation. A call whose items are of other types takes the look at each item.
_PLAIN_ITEMS = frozenset({str, int, list, tuple, np.ndarray})


def plain_inputs(inputs) -> bool:
    """Whether a call's inputs are texts or token ids alone (one text, an array, or a list or
    tuple of texts, token-id lists or arrays): the common calls, told apart by the set of their
    items' types in one C-level pass, where looking at each input for images and dicts took
    four Python calls an input on the calling thread (8,192 token-id lists: ~33,000)."""
    kind = type(inputs)
    if kind is str or kind is np.ndarray:
        return True
    if kind is not list and kind is not tuple:
        return False
    return all(t in _PLAIN_ITEMS or issubclass(t, np.integer) for t in {*map(type, inputs)})


def is_image_input(item) -> bool:
    """Whether one input is an image rather than text or token ids."""
    if isinstance(item, str):
        return False
    if isinstance(item, (bytes, bytearray, memoryview, Path)):
        return True
    # An object can be a PIL image only once Pillow's image module is loaded: looked up, not
    # imported, at each call.
    pil_image = sys.modules.get("PIL.Image")
    return pil_image is not None and isinstance(item, pil_image.Image)


def image_inputs(inputs) -> list | None:
    """The call's inputs as a list of images when they are images (all of them: one modality
    per call), None when none is; raises InvalidInputError for a mix."""
    if plain_inputs(inputs):  # texts or token ids: no look at each input
        return None
    if isinstance(inputs, (str, bytes, bytearray, memoryview, Path)) or is_image_input(inputs):
        return [inputs] if is_image_input(inputs) else None
    if not isinstance(inputs, Sequence) or not len(inputs):
        return None
    kinds = [is_image_input(item) for item in inputs]
    if not any(kinds):
        return None
    if not all(kinds):
        text = kinds.index(False)
        raise InvalidInputError(
            f"input {text}: a call embeds images or texts, not both (input {kinds.index(True)} "
            "is an image)",
            param="input",
            index=text,
        )
    return list(inputs)
