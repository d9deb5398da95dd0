"""ColPali (transformers' ``ColPaliForRetrieval``): a PaliGemma (a SigLIP vision tower, a linear
``multi_modal_projector`` and the first Gemma's decoder), every token's final state projected
by ``embedding_proj_layer`` (one vector per token, normalised per token by the pooler), scored
by MaxSim.

What transformers 5.17 computes on its processor's inputs, and so what is computed here:

- Attention is bidirectional over the whole prompt. ``ColPaliProcessor`` returns
  ``token_type_ids``, all zero (a prefix, no suffix), and ``PaliGemmaModel`` turns a zero type
  into one bidirectional block (``block_sequence_ids``), masked by padding only; PaliGemma's
  config makes its Gemma ``use_bidirectional_attention`` as well. So the decoder runs as an
  encoder: a prompt goes whole into one step and never chunks (one longer than the token
  budget runs alone in its step, as any encoder prompt).
- Positions start at 1 (``PaliGemmaModel``: "Paligemma positions are 1-indexed").
- Text tokens are embedded scaled by sqrt(hidden) (rounded to the dtype, Gemma's
  ``embed_scale``); image features replace the image tokens' embeddings unscaled: the vision
  tower's ``last_hidden_state`` (``post_layernorm`` applied, the pooling head unused) through
  ``multi_modal_projector``, as ``masked_scatter`` places them.

The first stage holds the vision tower (``SiglipFeatures``): the runner has it encode the
images of the requests a plan starts, and hands the step the rows of the image tokens it holds
(``StepInputs.image_embeds``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ..core.classifier_head import ClassifierHead
from ..core.media import FEATURE_ROW, ImageInput
from ..errors import ModelLoadError
from .base import StepInputs, WeightSpec, linear_specs
from .gemma import GemmaConfig, GemmaStage, embed_scale
from .towers import TowerConfig, TowerLayer, norm_specs


@dataclass(frozen=True)
class ColPaliConfig:
    """A ColPali config.json: its PaliGemma's (``vlm_config``) Gemma decoder and SigLIP vision
    tower, the image token, and the projection's width."""

    text: GemmaConfig
    vision: TowerConfig
    image_token_id: int
    embedding_dim: int

    @classmethod
    def from_hf(cls, hf: dict, family: str, *, causal: bool = False) -> ColPaliConfig:
        if causal:
            raise ModelLoadError(
                "ColPali attends bidirectionally over the whole prompt (as transformers runs it "
                "on its processor's inputs); causal attention is not what it computes"
            )
        vlm = hf.get("vlm_config")
        if not isinstance(vlm, dict) or vlm.get("model_type", "paligemma") != "paligemma":
            raise ModelLoadError(
                "ColPali: vlm_config must be a PaliGemma config (model_type paligemma); got "
                f"{vlm.get('model_type') if isinstance(vlm, dict) else vlm!r}"
            )
        text, vision = paligemma_text(vlm), vlm.get("vision_config")
        if text.get("model_type", "gemma") != "gemma":
            raise ModelLoadError(
                f"ColPali: a {text.get('model_type')!r} decoder (PaliGemma 2's Gemma2) is not "
                "implemented; the first Gemma (model_type gemma) is"
            )
        if not isinstance(vision, dict) or vision.get("model_type", "siglip_vision_model") != (
            "siglip_vision_model"
        ):
            raise ModelLoadError("ColPali: vlm_config.vision_config must be a SigLIP vision one")
        image_token = vlm.get("image_token_index", vlm.get("image_token_id", 256000))
        decoder = GemmaConfig.from_hf(text, "gemma", causal=False)
        # The tower's own pooling head is unused (PaliGemma reads last_hidden_state): read the
        # tower as SigLIP's, then without its head.
        tower = TowerConfig.from_hf(
            {"vision_config": {**vision, "vision_use_head": True}}, "siglip", "vision"
        )
        tower = replace(tower, attention_pooling=False)
        projection = int(vlm.get("projection_dim", 2048))
        if projection != decoder.hidden_size:
            raise ModelLoadError(
                f"ColPali: projection_dim {projection} differs from the decoder's hidden_size "
                f"{decoder.hidden_size} (image features replace token embeddings)"
            )
        if not isinstance(image_token, int):
            raise ModelLoadError("ColPali: vlm_config.image_token_index is not an integer")
        return cls(decoder, tower, image_token, int(hf.get("embedding_dim", 128)))


def paligemma_text(vlm: dict) -> dict:
    """The Gemma config of a PaliGemma one, with transformers' PaliGemma defaults where absent."""
    text = dict(vlm.get("text_config") or {})
    if not text:  # PaliGemmaConfig's default decoder
        text = dict(hidden_size=2048, num_hidden_layers=18, intermediate_size=16384,
                    num_attention_heads=8, num_key_value_heads=1)  # fmt: skip
    text.setdefault("vocab_size", vlm.get("vocab_size", 257152))
    return text


class SiglipFeatures(nn.Module):
    """PaliGemma's image features: SigLIP's vision tower (patch embedding, positions, pre-norm
    layers, ``post_layernorm``) over each image's patches, then ``multi_modal_projector``:
    ``[patches, decoder hidden]`` per image. Every image has the tower's fixed size, so a call's
    images run as one batch, each attending over its own patches."""

    def __init__(self, cfg: TowerConfig, out_dim: int) -> None:
        super().__init__()
        self.cfg, h = cfg, cfg.hidden_size
        self.patch_weight = nn.Parameter(torch.empty(h, cfg.num_channels, cfg.patch_size,
                                                     cfg.patch_size))  # fmt: skip
        self.patch_bias = nn.Parameter(torch.empty(h))
        self.position_embedding = nn.Parameter(torch.empty(cfg.num_patches, h))
        self.layers = nn.ModuleList(TowerLayer(cfg) for _ in range(cfg.num_layers))
        self.post_layernorm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.projector = nn.Linear(h, out_dim)

    def encode(self, images: list[ImageInput]) -> torch.Tensor:
        """``[images x patches, out_dim]``: each image's rows, in image order."""
        w = self.patch_weight
        pixels = torch.stack([torch.from_numpy(i.pixels) for i in images]).to(w.device, w.dtype)
        x = F.linear(pixels, w.flatten(1), self.patch_bias)  # the patch convolution
        x = x + self.position_embedding
        for layer in self.layers:
            x = _tower_layer(cast(TowerLayer, layer), x)
        return self.projector(self.post_layernorm(x)).flatten(0, 1)

    def weight_specs(self, ckpt: str, param: str) -> list[WeightSpec]:
        cfg, h = self.cfg, self.cfg.hidden_size
        c, p = cfg.num_channels, cfg.patch_size
        specs = [
            WeightSpec(f"{ckpt}.embeddings.patch_embedding.weight", (h, c, p, p),
                       f"{param}.patch_weight"),
            WeightSpec(f"{ckpt}.embeddings.patch_embedding.bias", (h,), f"{param}.patch_bias"),
            WeightSpec(f"{ckpt}.embeddings.position_embedding.weight", (cfg.num_patches, h),
                       f"{param}.position_embedding"),
        ]  # fmt: skip
        for i in range(cfg.num_layers):
            specs += TowerLayer.specs(cfg, f"{ckpt}.encoder.layers.{i}", f"{param}.layers.{i}")
        specs += norm_specs(f"{ckpt}.post_layernorm", f"{param}.post_layernorm", h)
        out = self.projector.out_features
        specs += linear_specs("multi_modal_projector.linear", f"{param}.projector", out, h, True)
        return specs


def _tower_layer(layer: TowerLayer, x: torch.Tensor) -> torch.Tensor:
    """SigLIP's encoder layer on ``[images, patches, hidden]``: bidirectional within each
    image (the weights and arithmetic of ``TowerLayer``, batched by image)."""
    b, n, h = x.shape
    q, k, v = layer.qkv(layer.norm1(x)).view(b, n, 3 * layer.num_heads, layer.head_dim).chunk(3, 2)
    a = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=layer.head_dim**-0.5
    )
    x = x + layer.out(a.transpose(1, 2).reshape(b, n, h))
    return x + layer.fc2(layer.act(layer.fc1(layer.norm2(x))))


class ColPaliStage(GemmaStage):
    """A slice of ColPali's decoder (bidirectional, whole prompts); the first stage holds the
    vision tower (``encode_images``), the last projects every row to ``embedding_dim``."""

    graph_safe = False  # per-step image rows: no graph buffers for them
    compiles = False  # eager layers
    fixed_pooling = True  # one vector per token, as the checkpoint scores them

    def __init__(
        self,
        cfg: ColPaliConfig,
        layers: range,
        first: bool,
        last: bool,
        max_len: int,
        head: ClassifierHead | None = None,
    ) -> None:
        if head is not None:
            raise ModelLoadError("a ColPali checkpoint has no classifier head")
        # Positions start at 1: one more row of the rotary table than prompt tokens.
        super().__init__(cfg.text, layers, first, last, max_len + 1)
        self.colpali = cfg
        self.keeps_rows = False  # every token is an output
        self.visual = SiglipFeatures(cfg.vision, cfg.text.hidden_size) if first else None
        self.image_token_id = cfg.image_token_id if first else None
        self.projection = nn.Linear(cfg.text.hidden_size, cfg.embedding_dim) if last else None
        self.graph_safe = False  # GemmaStage decides it from its layers alone

    def graph_safe_with(self, kernel: str) -> bool:
        return False  # with any kernel: image rows and positions come per step

    @property
    def output_size(self) -> int:
        return self.colpali.embedding_dim

    def encode_images(self, images: list[ImageInput]) -> torch.Tensor:
        """The image features of ``images``, in order (first stage only)."""
        assert self.visual is not None, "only the first stage holds the vision tower"
        return self.visual.encode(images)

    def forward(self, x: torch.Tensor, inputs: StepInputs, kv_caches) -> torch.Tensor:
        media = inputs.media
        if self.is_first:
            # transformers looks an out-of-vocabulary image token up as id 0 (then replaced).
            x = torch.where(x < self.cfg.vocab_size, x, 0)
            x = self.embed_tokens(x)
            x = x * embed_scale(self.cfg.hidden_size, x.dtype)
            if inputs.image_embeds is not None:
                assert media is not None, "image rows come with media rows"
                x = x.clone()
                x[media[:, FEATURE_ROW] > 0] = inputs.image_embeds.to(x.dtype)
        # The plan's positions where it carries media rows (core/media.py), counted from 1.
        positions = media[:, 0] if media is not None else inputs.positions
        x = self.decoder_layers(x, replace(inputs, positions=positions + 1), kv_caches)
        return self.projection(x) if self.projection is not None else x

    def weight_specs(self) -> list[WeightSpec]:
        specs = super().weight_specs()
        if self.visual is not None:
            specs += self.visual.weight_specs("vision_tower", "visual")
        if self.projection is not None:
            h, dim = self.cfg.hidden_size, self.colpali.embedding_dim
            specs += linear_specs("embedding_proj_layer", "projection", dim, h, True)
        return specs
