"""Inputs of ColPali (``models/colpali.py``), formatted as transformers' ``ColPaliProcessor``
formats them: a query (a dict with ``text`` only) is ``bos + query_prefix + text + pad * 10 +
"\\n"`` (the pads are its query augmentation tokens), a page (a dict with one ``image`` only)
``image_token * image_seq_length + bos + visual_prompt_prefix + "\\n"``, tokenised without
adding special tokens (the processor turns them off). The prefixes come from the folder's
processor_config.json, else the processor's defaults. Images are preprocessed as SigLIP's PIL
image processor (``intake/images.py``), always converted to RGB as the processor asks, and cut
into the vision tower's patches, row-major."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..core.media import ImageInput
from ..errors import InvalidInputError, ModelLoadError
from ..loading.st_dual_encoder import processor_config
from .images import ImageLimits, ImageProcessing, decode_image
from .tokenizer import encode_unlocked
from .vlm_inputs import VlmPrompt, media_rows

# ColPaliProcessor's defaults.
_QUERY_PREFIX, _VISUAL_PREFIX, _AUGMENTATION = "Question: ", "Describe the image.", 10


class ColPaliFormatter:
    """Dict inputs to ``VlmPrompt``s as ColPaliProcessor makes them (module doc); positions
    are each token's index (the stages count them from 1)."""

    def __init__(self, folder: Path, tokenizer_file: Path, image_token: int,
                 limits: ImageLimits, *, image_size: int, patch_size: int) -> None:  # fmt: skip
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self.image_token, self.limits, self.patch = image_token, limits, patch_size
        piece = self.tokenizer.id_to_token(image_token)
        if piece is None:
            raise ModelLoadError(f"{tokenizer_file}: no token of the image token id {image_token}")
        self.image_piece: str = piece
        images = ImageProcessing.from_folder(
            folder, "siglip", image_size, read_elsewhere=frozenset({"image_seq_length"})
        )
        # ColPaliProcessor passes do_convert_rgb=True to its image processor whatever the
        # config says (its published configs say null).
        self.images = replace(images, do_convert_rgb=True)
        self.num_patches = (image_size // patch_size) ** 2
        file, given = processor_config(folder)
        length = given.get("image_seq_length", self.num_patches)
        if length != self.num_patches:
            raise ModelLoadError(
                f"{file}: image_seq_length {length} differs from the vision tower's "
                f"{self.num_patches} patches (each image token takes one patch's features)"
            )
        prefixes = _json(folder / "processor_config.json")
        self.query_prefix = _string(prefixes, "query_prefix", _QUERY_PREFIX, folder)
        self.visual_prefix = _string(prefixes, "visual_prompt_prefix", _VISUAL_PREFIX, folder)
        tokens = _json(folder / "tokenizer_config.json")
        self.bos, self.pad = (
            _token(tokens, "bos_token", folder),
            _token(tokens, "pad_token", folder),
        )

    def render(self, text: str, num_images: int, index: int) -> str:
        if num_images == 0:
            return f"{self.bos}{self.query_prefix}{text}{self.pad * _AUGMENTATION}\n"
        if num_images == 1 and not text:
            return f"{self.image_piece * self.num_patches}{self.bos}{self.visual_prefix}\n"
        raise InvalidInputError(
            f"input {index}: ColPali embeds a query (text only) or a page (one image only)",
            param="input", index=index,
        )  # fmt: skip

    def image_input(self, image) -> ImageInput:
        """The image's patches ``[patches, channels x patch x patch]`` float32, row-major over
        the patch grid, each patch's values in the patch convolution's order."""
        pixels = self.images.pixel_values(image)
        c, h, w = pixels.shape
        p = self.patch
        patches = pixels.reshape(c, h // p, p, w // p, p).transpose(1, 3, 0, 2, 4)
        return ImageInput(np.ascontiguousarray(patches.reshape(-1, c * p * p)), (1, h // p, w // p))

    def prompt(self, text: str, decoded: list, index: int) -> VlmPrompt:
        rendered = self.render(text, len(decoded), index)
        images = tuple(self.image_input(image) for image in decoded)
        encoded = encode_unlocked(self.tokenizer, rendered, add_special_tokens=False, offsets=False)
        ids = np.asarray(encoded.ids, np.int64)
        try:
            media = media_rows(ids, self.image_token, [self.num_patches] * len(images), 1,
                               [i.grid for i in images], mrope=False)  # fmt: skip
        except ValueError as exc:
            raise InvalidInputError(f"input {index}: {exc}", param="input", index=index) from None
        return VlmPrompt(ids, media, images)

    def decode(self, item, index: int) -> list:
        return [decode_image(image, index, self.limits) for image in item]


def _json(file: Path) -> dict:
    return json.loads(file.read_text()) if file.is_file() else {}


def _string(given: dict, key: str, default: str, folder: Path) -> str:
    value = given.get(key, default)
    if not isinstance(value, str):
        raise ModelLoadError(f"{folder}/processor_config.json: {key} is not a string")
    return value


def _token(config: dict, key: str, folder: Path) -> str:
    """A special token of tokenizer_config.json (a string, or an AddedToken's dict)."""
    value = config.get(key)
    value = value.get("content") if isinstance(value, dict) else value
    if not isinstance(value, str):
        raise ModelLoadError(f"{folder}/tokenizer_config.json: no {key}, which ColPali's "
                             "prompts hold")  # fmt: skip
    return value
