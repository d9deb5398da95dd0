"""Qwen2-VL and Qwen2.5-VL as embedding models (GME and other embedders built on them):
transformers' ``Qwen2VLModel`` / ``Qwen2VLForConditionalGeneration`` and their Qwen2.5-VL
twins, the last token's final hidden state. The two share the decoder and the inputs; their
vision towers differ (``qwen2_vl_vision.py``).

The decoder is Qwen2's (``decoder.py``), with multimodal rotary positions (M-RoPE): each token
has a temporal, a height and a width position (``core/media.py``: from the plan, one row per
token), and the rotary frequencies are split in ``mrope_section`` parts, part i rotating by
axis i's position, as transformers' ``Qwen2VLRotaryEmbedding`` composes them. A text token's
three positions are equal, so a prompt without images is rotated as by 1-D RoPE.

The first stage also holds the vision tower (``qwen2_vl_vision.py``): the runner has it encode
the images of the requests a plan starts, and hands the step the feature rows of the image
placeholder tokens it holds (``StepInputs.image_embeds``), which replace those tokens'
embeddings, as transformers' ``masked_scatter`` does."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from ..core.classifier_head import ClassifierHead
from ..core.media import FEATURE_ROW, ImageInput
from ..errors import ModelLoadError
from .base import StepInputs, WeightSpec
from .decoder import DecoderConfig, DecoderStage
from .qwen2_vl_vision import VisionConfig, VisionTower

_DEFAULT_SECTION = (16, 24, 24)  # transformers' default mrope_section


def text_config(hf: dict) -> dict:
    """The decoder's fields: ``text_config`` (transformers 5's layout), else the top level
    (the layout of the published Qwen2-VL checkpoints)."""
    sub = hf.get("text_config")
    if isinstance(sub, dict) and sub:
        return dict(sub)
    return {k: v for k, v in hf.items() if k != "vision_config"}


def vl_parts(
    hf: dict,
    text: dict,
    rope: dict,
    label: str,
    decoder_family: str,
    default_section: tuple[int, ...],
    default_theta: float,
    unread: tuple[str, ...],
) -> tuple[DecoderConfig, tuple[int, ...], dict, int]:
    """What every Qwen-VL config.json holds alike: the causal decoder (M-RoPE's theta as a
    plain rotary table, the ``unread`` text fields dropped), its checked M-RoPE sections, the
    vision_config and the image placeholder token."""
    section = tuple(int(s) for s in rope.get("mrope_section", default_section))
    theta = rope.get("rope_theta", text.get("rope_theta", default_theta))
    for name in unread:
        text.pop(name, None)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    decoder = DecoderConfig.from_hf(text, decoder_family, causal=True)
    if len(section) != 3 or sum(section) * 2 != decoder.rotary_dim:
        raise ModelLoadError(
            f"mrope_section {list(section)}: three parts adding up to half the rotary "
            f"dimension ({decoder.rotary_dim // 2}) expected"
        )
    vision = hf.get("vision_config")
    if not isinstance(vision, dict):
        raise ModelLoadError(f"config.json of a {label} model has no vision_config")
    image_token = hf.get("image_token_id", text.get("image_token_id"))
    if not isinstance(image_token, int):
        raise ModelLoadError(f"config.json of a {label} model has no image_token_id")
    return decoder, section, vision, image_token


@dataclass(frozen=True)
class Qwen2VLConfig:
    """A Qwen2-VL config.json: the decoder, the vision tower, the M-RoPE sections and the
    image placeholder token."""

    text: DecoderConfig
    vision: VisionConfig
    mrope_section: tuple[int, ...]
    image_token_id: int

    @classmethod
    def from_hf(cls, hf: dict, family: str, *, causal: bool = True) -> Qwen2VLConfig:
        if not causal:
            raise ModelLoadError("Qwen2-VL's decoder is causal; bidirectional is not implemented")
        text = text_config(hf)
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "mrope"):
            raise ModelLoadError(f"Qwen2-VL rope type {kind!r} is not implemented (M-RoPE)")
        decoder, section, vision, image_token = vl_parts(
            hf, text, rope, "Qwen2-VL", "qwen2", _DEFAULT_SECTION, 1000000.0, ("rope_scaling",)
        )
        windowed = family == "qwen2_5_vl"  # Qwen2.5-VL's vision tower
        vision_cfg = VisionConfig.from_hf(vision, decoder.hidden_size, windowed=windowed)
        return cls(decoder, vision_cfg, section, image_token)


class ImageTower(Protocol):
    """A vision tower of the first stage (an ``nn.Module``): images in, one row per image
    placeholder token out, in image order."""

    def encode(self, images: list[ImageInput]) -> torch.Tensor: ...

    def weight_specs(self, prefix: str, param: str) -> list[WeightSpec]: ...


def _axes(section: tuple[int, ...]) -> torch.Tensor:
    """The position axis (t, h, w) each component of the cos|sin table turns by."""
    half = [axis for axis, n in enumerate(section) for _ in range(n)]
    return torch.tensor(half + half, dtype=torch.int64)


class Qwen2VLStage(DecoderStage):
    """A slice of Qwen2-VL's decoder; the first stage holds the vision tower (``encode``)."""

    graph_safe = False  # per-step rotary tables and image rows: no graph buffers for them
    compiles = False  # eager layers (a compiled M-RoPE body is future work)

    def __init__(
        self,
        cfg: Qwen2VLConfig,
        layers: range,
        first: bool,
        last: bool,
        max_len: int,
        head: ClassifierHead | None = None,
    ) -> None:
        if head is not None:
            raise ModelLoadError("a Qwen2-VL checkpoint has no classifier head here")
        super().__init__(cfg.text, layers, first, last, max_len)
        self.vl = cfg
        self.visual = self.vision_tower() if first else None
        self.image_token_id = cfg.image_token_id if first else None
        self.register_buffer("axes", self.rope_axes(), persistent=False)

    def vision_tower(self) -> ImageTower:
        """The first stage's vision tower (``encode``, ``weight_specs``)."""
        return VisionTower(self.vl.vision)

    def rope_axes(self) -> torch.Tensor:
        """The position axis (t, h, w) each component of the cos|sin table turns by."""
        return _axes(self.vl.mrope_section)

    def reset_buffers(self) -> None:
        super().reset_buffers()
        self.axes = self.rope_axes().to(self.rotary.cos_sin.device)

    def encode_images(self, images: list[ImageInput]) -> torch.Tensor:
        """The vision tower's rows for ``images``, in order (first stage only)."""
        assert self.visual is not None, "only the first stage holds the vision tower"
        return self.visual.encode(images)

    def forward(self, x: torch.Tensor, inputs: StepInputs, kv_caches) -> torch.Tensor:
        cos_sin = self.rotary.cos_sin
        media = inputs.media
        if self.is_first:
            x = self.embed_tokens(x)
            if inputs.image_embeds is not None:
                assert media is not None, "image rows come with media rows"
                x = x.clone()
                x[media[:, FEATURE_ROW] > 0] = inputs.image_embeds.to(x.dtype)
        if media is not None:
            # Each token's own row of the table: component j at its axis' position.
            cos_sin = cos_sin.gather(0, media[:, self.axes])
            inputs = replace(inputs, positions=torch.arange(len(media), device=media.device))
        last = len(self.layers) - 1
        for j, layer in enumerate(self.layers.values()):
            kv = kv_caches[j] if kv_caches is not None else None
            keep = inputs.keep_rows if self.is_last and j == last else None
            x = layer(x, inputs, kv, cos_sin, self.ops, self.attn_kernel, keep)
        if self.is_last:
            x = self.norm(x)
        return x

    def weight_specs(self) -> list[WeightSpec]:
        specs = super().weight_specs()
        if self.visual is not None:
            specs += self.visual.weight_specs("visual", "visual")
        return specs
