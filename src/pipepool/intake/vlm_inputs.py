"""Inputs of a vision-language embedder (Qwen2-VL, Qwen2.5-VL and Qwen3-VL,
``models/qwen2_vl.py``, ``models/qwen3_vl.py``): a text and its
images, formatted as the folder's processor formats them, to token ids, media rows and
preprocessed images (``core/media.py``).

An input is a dict: ``{"text": str, "image": image}`` or ``{"text": ..., "images": [...]}``
(either key optional, not both; an image is a PIL image, bytes or a ``pathlib.Path`` under the
allowed folder). It becomes one user message whose content is its images, then its text, as
GME and Qwen3-VL-Embedding build theirs (with ``"instruction": str``, a system message of it
before, as Qwen3-VL-Embedding's reference code writes one; no instruction, no system message:
the template's own default, if any); the folder's chat template renders it with
``add_generation_prompt=True``; each image's ``<|image_pad|>`` is expanded to its number of
placeholder tokens (patches / merge**2), and the text is tokenised as the processor does.
M-RoPE positions follow transformers' ``get_rope_index``: text tokens count on, an image's
tokens take (start, start + row, start + column) on the merged grid, and the text after an
image resumes at start + max(rows, columns)."""

from __future__ import annotations

import json
import math
import unicodedata
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..core.media import MEDIA_COLUMNS, ImageInput
from ..errors import InvalidInputError, ModelLoadError
from ..loading.st_dual_encoder import checked_processor_config
from .chat_templates import compiled_chat_template
from .conversation import ChatMessage, Conversation, ImagePart, TextPart
from .images import ImageLimits, ImageProcessing, decode_image
from .tokenizer import encode_unlocked
from .vlm_chat import ChatPrompt, check_chat_options, render_chat

_CLIP_MEAN, _CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
# preprocessor_config.json keys read below; the bookkeeping ones change nothing computed.
_READ = {
    "do_resize", "size", "min_pixels", "max_pixels", "resample", "do_rescale", "rescale_factor",
    "do_normalize", "image_mean", "image_std", "do_convert_rgb", "patch_size",
    "temporal_patch_size", "merge_size",
}  # fmt: skip
_IGNORED = {"image_processor_type", "processor_class", "default_to_square"}
# Qwen2.5-VL's checkpoints name Qwen2-VL's image processor (transformers has no other).
_PROCESSORS = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")
IMAGE_PAD, INPUT_KEYS = "<|image_pad|>", ("text", "image", "images", "instruction")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int):
    """transformers' Qwen2-VL ``smart_resize``: sides multiples of ``factor``, the pixel count
    within bounds, the aspect ratio kept as closely as that allows."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} over 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = (
            math.ceil(height * beta / factor) * factor,
            math.ceil(width * beta / factor) * factor,
        )
    return h_bar, w_bar


@dataclass(frozen=True)
class Qwen2VLImages:
    """Qwen2-VL's image processor as ``preprocessor_config.json`` configures it: RGB, a PIL
    resize to ``smart_resize``'s size, rescale, normalise (``ImageProcessing``'s arithmetic),
    then patches of ``temporal_patch x patch x patch`` (an image repeated over the temporal
    patch), ordered block by merge block, as ``pixel_values``."""

    base: ImageProcessing
    min_pixels: int
    max_pixels: int
    patch: int
    temporal: int
    merge: int

    @classmethod
    def from_folder(cls, folder: Path) -> Qwen2VLImages:
        file, given = checked_processor_config(folder, _PROCESSORS, _READ, _IGNORED, "Qwen2-VL")
        if given.get("do_resize") is False:
            raise ModelLoadError(f"{file}: do_resize=false is not implemented")
        size = dict(given.get("size") or {})
        lo = given.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels")
        hi = given.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
        lo, hi = lo or 56 * 56, hi or 28 * 28 * 1280  # transformers' defaults
        base = ImageProcessing(
            do_resize=True, size={}, resample=int(given.get("resample", 3)),
            do_center_crop=False, crop_size=None, do_rescale=bool(given.get("do_rescale", True)),
            rescale_factor=float(given.get("rescale_factor", 1 / 255)),
            do_normalize=bool(given.get("do_normalize", True)),
            image_mean=tuple(given.get("image_mean", _CLIP_MEAN)),
            image_std=tuple(given.get("image_std", _CLIP_STD)),
            do_convert_rgb=bool(given.get("do_convert_rgb", True)),
        )  # fmt: skip
        return cls(
            base, int(lo), int(hi), int(given.get("patch_size", 14)),
            int(given.get("temporal_patch_size", 2)), int(given.get("merge_size", 2)),
        )  # fmt: skip

    def image_input(self, image, index: int) -> ImageInput:
        factor = self.patch * self.merge
        try:
            h, w = smart_resize(image.height, image.width, factor, self.min_pixels, self.max_pixels)
        except ValueError as exc:
            raise InvalidInputError(f"input {index}: {exc}", param="input", index=index) from None
        pixels = replace(self.base, size={"height": h, "width": w}).pixel_values(image)
        c, p, m, t = pixels.shape[0], self.patch, self.merge, self.temporal
        gh, gw = h // p, w // p
        patches = pixels.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
        return ImageInput(
            np.ascontiguousarray(patches.reshape(gh * gw, c * t * p * p)), (1, gh, gw)
        )

    def tokens(self, image: ImageInput) -> int:
        return image.grid[0] * image.grid[1] * image.grid[2] // self.merge**2


def media_rows(ids: np.ndarray, image_token: int, token_counts: list[int], merge: int,
               grids: list[tuple[int, int, int]], *, mrope: bool = True) -> np.ndarray:  # fmt: skip
    """[len(ids), MEDIA_COLUMNS]: transformers' ``get_rope_index`` positions (``mrope``; else
    each token's index on every axis, as ColQwen2 runs) and the feature row of each
    placeholder; ``token_counts[i]``: image i's placeholders, ``grids[i]`` its patch grid."""
    media = np.zeros((len(ids), MEDIA_COLUMNS), dtype=np.int64)
    is_image = ids == image_token
    edges = np.flatnonzero(np.diff(np.concatenate([[0], is_image.astype(np.int8), [0]])))
    runs = list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))
    if [hi - lo for lo, hi in runs] != token_counts:
        raise ValueError(f"placeholder runs {[hi - lo for lo, hi in runs]} for images of "
                         f"{token_counts} tokens")  # fmt: skip
    pos, done, feature = 0, 0, 1
    for (lo, hi), (t, h, w) in zip(runs, grids, strict=True):
        media[done:lo, :3] = (np.arange(lo - done) + pos)[:, None]
        pos += lo - done
        gt, gh, gw = t, h // merge, w // merge
        tt, hh, ww = np.meshgrid(np.arange(gt), np.arange(gh), np.arange(gw), indexing="ij")
        media[lo:hi, 0] = tt.reshape(-1) + pos
        media[lo:hi, 1] = hh.reshape(-1) + pos
        media[lo:hi, 2] = ww.reshape(-1) + pos
        media[lo:hi, 3] = np.arange(feature, feature + hi - lo)
        feature += hi - lo
        pos += max(gh, gw)
        done = hi
    media[done:, :3] = (np.arange(len(ids) - done) + pos)[:, None]
    if not mrope:
        media[:, :3] = np.arange(len(ids))[:, None]
    return media


@dataclass(frozen=True)
class VlmPrompt:
    """One input, ready to enqueue: its token ids, media rows and images."""

    token_ids: np.ndarray
    media: np.ndarray
    images: tuple[ImageInput, ...]


def parse_input(item, index: int) -> tuple[str | ChatPrompt, list]:
    """(text, images) of one dict input, (the prompt, its images) of a ``ChatPrompt`` or of a
    dict with an instruction (``_instructed``); refuses other keys and shapes by name."""
    if isinstance(item, ChatPrompt):
        return item, item.images
    if not isinstance(item, dict):
        raise InvalidInputError(
            f"input {index}: a vision-language call takes dicts ({{'text': ..., 'image': ...}}) "
            f"or texts, got {type(item).__name__}", param="input", index=index,
        )  # fmt: skip
    videos = sorted(set(item) & {"video", "videos"})
    if videos:  # Qwen2-VL and Qwen3-VL read videos (Qwen3-VL with timestamps); pipepool not
        raise InvalidInputError(
            f"input {index}: {videos[0]!r}: video inputs are not implemented (images only)",
            param="input", index=index,
        )  # fmt: skip
    unknown = sorted(set(item) - set(INPUT_KEYS))
    if unknown:
        raise InvalidInputError(
            f"input {index}: key {unknown[0]!r} is not one of {', '.join(INPUT_KEYS)}",
            param="input", index=index,
        )  # fmt: skip
    if "image" in item and "images" in item:
        raise InvalidInputError(f"input {index}: give 'image' or 'images', not both",
                                param="input", index=index)  # fmt: skip
    text = item.get("text", "")
    if not isinstance(text, str):
        raise InvalidInputError(f"input {index}: 'text' is not a string", param="input",
                                index=index)  # fmt: skip
    images = item.get("images", [item["image"]] if "image" in item else [])
    if not isinstance(images, (list, tuple)):
        raise InvalidInputError(f"input {index}: 'images' is not a list", param="input",
                                index=index)  # fmt: skip
    if not text and not images:
        raise InvalidInputError(f"input {index}: neither text nor image", param="input",
                                index=index)  # fmt: skip
    if "instruction" in item:
        return _instructed(item["instruction"], text, list(images), index), list(images)
    return text, list(images)


def _instructed(instruction, text: str, images: list, index: int) -> ChatPrompt:
    """A dict input with an instruction as Qwen3-VL-Embedding's reference formats it: a system
    message of the instruction (stripped, a full stop added unless it ends in punctuation), then
    the user message of the images and the text, with the generation prompt."""
    if not isinstance(instruction, str) or not instruction.strip():
        raise InvalidInputError(f"input {index}: 'instruction' is not a non-empty string",
                                param="input", index=index)  # fmt: skip
    instruction = instruction.strip()
    if not unicodedata.category(instruction[-1]).startswith("P"):
        instruction += "."
    where = f"input {index}"
    parts: list[TextPart | ImagePart] = [ImagePart(image, where) for image in images]
    parts += [TextPart(text, where)] if text else []
    conversation = Conversation((
        ChatMessage("system", (TextPart(instruction, where),)),
        ChatMessage("user", tuple(parts)),
    ))  # fmt: skip
    # the special tokens as for any dict input (``VlmFormatter.prompt``)
    return ChatPrompt(conversation, add_generation_prompt=True, add_special_tokens=True)


class VlmFormatter:
    """Dict inputs to ``VlmPrompt``s, as the folder's processor formats them (module doc)."""

    def __init__(self, folder: Path, tokenizer_file: Path, image_token: int,
                 limits: ImageLimits) -> None:  # fmt: skip
        from tokenizers import Tokenizer

        self.template, self.template_variables = self._template(folder)
        self.images = Qwen2VLImages.from_folder(folder)
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        if self.tokenizer.token_to_id(IMAGE_PAD) != image_token:
            raise ModelLoadError(f"{tokenizer_file}: {IMAGE_PAD} is not the config's image token")
        self.image_token, self.limits = image_token, limits
        self.mrope = True

    def _template(self, folder: Path):
        """The folder's chat template and the variables it reads (``chat_templates.py``)."""
        return compiled_chat_template(folder)

    def render(self, text: str, num_images: int, index: int) -> str:
        content = [{"type": "image"}] * num_images + ([{"type": "text", "text": text}] if text
                                                     else [])  # fmt: skip
        messages = [{"role": "user", "content": content}]
        return self.template.render(messages=messages, add_generation_prompt=True)

    def render_chat(self, prompt: ChatPrompt, index: int) -> str:
        check_chat_options(prompt, set(self.template_variables))
        return render_chat(self.template, prompt, index)

    def prompt(self, text: str | ChatPrompt, decoded: list, index: int) -> VlmPrompt:
        images = tuple(self.images.image_input(image, index) for image in decoded)
        if isinstance(text, ChatPrompt):
            rendered, special = self.render_chat(text, index), text.add_special_tokens
        else:
            rendered, special = self.render(text, len(images), index), True
        pieces = rendered.split(IMAGE_PAD)
        if len(pieces) != len(images) + 1:
            raise InvalidInputError(
                f"input {index}: the chat template wrote {len(pieces) - 1} image placeholders "
                f"for {len(images)} images", param="input", index=index,
            )  # fmt: skip
        counts = [self.images.tokens(i) for i in images]
        runs = (IMAGE_PAD * n + rest for n, rest in zip(counts, pieces[1:], strict=True))
        expanded = pieces[0] + "".join(runs)
        encoded = encode_unlocked(self.tokenizer, expanded, add_special_tokens=special,
                                  offsets=False)  # fmt: skip
        ids = np.asarray(encoded.ids, dtype=np.int64)
        try:
            grids = [i.grid for i in images]
            media = media_rows(ids, self.image_token, counts, self.images.merge, grids,
                               mrope=self.mrope)  # fmt: skip
        except ValueError as exc:
            raise InvalidInputError(f"input {index}: {exc}", param="input", index=index) from None
        return VlmPrompt(ids, media, images)

    def decode(self, item, index: int) -> list:
        return [decode_image(image, index, self.limits) for image in item]


class ColQwen2Formatter(VlmFormatter):
    """ColQwen2Processor's formats: a query (a dict with ``text`` only) is
    ``query_prefix + text + pad_token * 10 + "\\n"`` (its query augmentation), a page (a dict
    with one ``image`` only) ``visual_prompt_prefix`` with the image's placeholders; positions
    are each token's index (``models/colqwen2.py``). The prefixes come from the folder's
    processor_config.json, else transformers' defaults."""

    def __init__(self, folder: Path, tokenizer_file: Path, image_token: int,
                 limits: ImageLimits) -> None:  # fmt: skip
        super().__init__(folder, tokenizer_file, image_token, limits)
        self.mrope = False
        given = _json(folder / "processor_config.json")
        self.query_prefix = given.get("query_prefix") or "Query: "
        self.visual_prefix = given.get("visual_prompt_prefix") or _COLQWEN2_VISUAL
        pad = _json(folder / "tokenizer_config.json").get("pad_token")
        pad = pad.get("content") if isinstance(pad, dict) else pad
        if not isinstance(pad, str):
            raise ModelLoadError(f"{folder}: no pad_token, ColQwen2's query augmentation token")
        self.pad = pad

    def _template(self, folder: Path):
        return None, set()  # ColQwen2's prompts are its processor's, not a chat template's

    def render(self, text: str, num_images: int, index: int) -> str:
        if num_images == 0:
            return f"{self.query_prefix}{text}{self.pad * 10}\n"
        if num_images == 1 and not text:
            return self.visual_prefix
        raise InvalidInputError(
            f"input {index}: ColQwen2 embeds a query (text only) or a page (one image only)",
            param="input", index=index,
        )  # fmt: skip


_COLQWEN2_VISUAL = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the image."
    "<|im_end|><|endoftext|>"
)


def _json(file: Path) -> dict:
    return json.loads(file.read_text()) if file.is_file() else {}
