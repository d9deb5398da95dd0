"""Qwen3-VL's vision tower (transformers' ``Qwen3VLVisionModel``), run by the first stage of
its pipelines on the images of the requests a plan starts.

Its blocks are Qwen2-VL's (``qwen2_vl_vision.VisionBlock``: LayerNorm, 2-D rotary positions,
attention within each frame) with an ungated MLP of the config's activation
(``gelu_pytorch_tanh``); it differs around them:

- the patch embedding (a Conv3d, as a linear map of each patch's values) has a bias;
- learned position embeddings are added to the patches: a square table of
  ``num_position_embeddings`` entries, resampled to each image's patch grid by bilinear
  interpolation with aligned corners (transformers' ``get_vision_interpolation_indices_and_
  weights``: four taps a patch, in the processor's merge-block order);
- the merger is a LayerNorm over each patch, then fc1, GELU, fc2 over each merge block;
- DeepStack: after each block of ``deepstack_visual_indexes``, a merger of its own (its
  LayerNorm over the whole merge block) turns that block's output into one more row per
  placeholder token. Decoder layer i adds the i-th of them to its output at the image tokens
  (``qwen3_vl.py``).

``encode`` returns, per placeholder token, the merger's row and then each DeepStack row, side
by side (``[tokens, out_dim * (1 + deepstack)]``): one row a token, so that the first stage
holds and selects them by the plan's feature rows as it does Qwen2-VL's
(``stage/image_features.py``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ..core.media import ImageInput
from ..errors import ModelLoadError
from ..layers.activation import get_activation
from .base import WeightSpec, linear_specs
from .qwen2_vl_vision import VisionBlock, VisionConfig, block_major, pixel_rows, vision_rotary


@dataclass(frozen=True)
class Qwen3VisionConfig:
    """A Qwen3-VL ``vision_config``: its blocks' shapes (``block``), the learned position
    table's size and the blocks whose outputs feed DeepStack mergers."""

    block: VisionConfig
    num_positions: int
    deepstack: tuple[int, ...]

    @property
    def grid_side(self) -> int:
        return math.isqrt(self.num_positions)

    @classmethod
    def from_hf(cls, vision: dict, out_dim: int) -> Qwen3VisionConfig:
        act = vision.get("hidden_act", "gelu_pytorch_tanh")
        get_activation(act)  # refused at load time, not mid-request
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ModelLoadError(
                f"vision_config.rope_parameters.rope_type={rope['rope_type']!r} is not "
                "implemented (axial)"
            )
        embed, heads = int(vision.get("hidden_size", 1152)), int(vision.get("num_heads", 16))
        if embed % heads or (embed // heads) % 4:
            raise ModelLoadError(f"vision_config: width {embed} over {heads} heads")
        out = int(vision.get("out_hidden_size", 3584))
        if out != out_dim:
            raise ModelLoadError(
                f"vision_config: the merger's output {out} differs from the decoder's {out_dim}"
            )
        for name in ("patch_size", "temporal_patch_size"):
            if not isinstance(vision.get(name, 0), int):  # transformers allows pairs
                raise ModelLoadError(f"vision_config.{name}={vision[name]!r}: one size expected")
        depth = int(vision.get("depth", 27))
        deepstack = tuple(int(i) for i in vision.get("deepstack_visual_indexes", (8, 16, 24)))
        if list(deepstack) != sorted(set(deepstack)) or any(not 0 <= i < depth for i in deepstack):
            raise ModelLoadError(
                f"vision_config.deepstack_visual_indexes={list(deepstack)}: increasing block "
                f"indexes below depth {depth} expected"
            )
        positions = int(vision.get("num_position_embeddings", 2304))
        if math.isqrt(positions) ** 2 != positions:
            raise ModelLoadError(
                f"vision_config.num_position_embeddings={positions}: a square grid expected"
            )
        block = VisionConfig(
            depth=depth, embed_dim=embed, num_heads=heads,
            mlp_dim=int(vision.get("intermediate_size", 4304)), hidden_act=act, out_dim=out,
            patch_size=int(vision.get("patch_size", 16)),
            temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
            merge_size=int(vision.get("spatial_merge_size", 2)),
            in_channels=int(vision.get("in_channels", 3)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )  # fmt: skip
        return cls(block, positions, deepstack)


class Merger(nn.Module):
    """``Qwen3VLVisionPatchMerger``: LayerNorm (over each patch, or with ``post_shuffle`` over
    each merge block of patches), then fc1, GELU, fc2 over each merge block."""

    def __init__(self, cfg: VisionConfig, post_shuffle: bool) -> None:
        super().__init__()
        self.width = cfg.embed_dim * cfg.merge_size**2
        self.post_shuffle = post_shuffle
        self.norm = nn.LayerNorm(self.width if post_shuffle else cfg.embed_dim, eps=1e-6)
        self.fc1 = nn.Linear(self.width, self.width)
        self.fc2 = nn.Linear(self.width, cfg.out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width) if self.post_shuffle else x).view(-1, self.width)
        return self.fc2(F.gelu(self.fc1(x)))

    def specs(self, ckpt: str, param: str) -> list[WeightSpec]:
        d = self.norm.normalized_shape[0]
        return [
            WeightSpec(f"{ckpt}.norm.weight", (d,), f"{param}.norm.weight"),
            WeightSpec(f"{ckpt}.norm.bias", (d,), f"{param}.norm.bias"),
            *linear_specs(f"{ckpt}.linear_fc1", f"{param}.fc1", self.width, self.width, True),
            *linear_specs(f"{ckpt}.linear_fc2", f"{param}.fc2", self.fc2.out_features,
                          self.width, True),
        ]  # fmt: skip


def position_taps(grid: tuple[int, int, int], merge: int, side: int, device):
    """Indices ``[patches, 4]`` into the flattened ``side x side`` position table and their
    bilinear weights (float32), aligned corners, patches in merge-block order, repeated over
    the grid's frames: transformers' ``get_vision_interpolation_indices_and_weights``."""
    t, h, w = grid
    rows, cols = block_major(h, w, merge, device)
    offsets = torch.arange(0, 2, device=device)

    def axis(index: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
        floor = torch.floor(src)
        taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
        weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
        return taps, weights

    (h_taps, h_w), (w_taps, w_w) = axis(rows, h), axis(cols, w)
    index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weight = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
    return index.repeat(t, 1), weight.repeat(t, 1)


class Qwen3VisionTower(nn.Module):
    """Images in; per placeholder token, the merger's row then each DeepStack row
    (``encode``)."""

    def __init__(self, cfg: Qwen3VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        b = cfg.block
        d, c, t, p = b.embed_dim, b.in_channels, b.temporal_patch_size, b.patch_size
        self.patch_weight = nn.Parameter(torch.empty(d, c, t, p, p))  # the Conv3d's
        self.patch_bias = nn.Parameter(torch.empty(d))
        self.pos_table = nn.Parameter(torch.empty(cfg.num_positions, d))
        self.blocks = nn.ModuleList([VisionBlock(b) for _ in range(b.depth)])
        self.merger = Merger(b, post_shuffle=False)
        self.deepstack = nn.ModuleList([Merger(b, post_shuffle=True) for _ in cfg.deepstack])

    def encode(self, images: list[ImageInput]) -> torch.Tensor:
        """``[sum of placeholder tokens, out_dim * (1 + deepstack)]``, in image order."""
        cfg, b = self.cfg, self.cfg.block
        weight = self.patch_weight
        pixels = pixel_rows(images, weight.device)
        x = F.linear(pixels.to(weight.dtype), weight.flatten(1), self.patch_bias)
        grids = [i.grid for i in images]
        taps = [position_taps(g, b.merge_size, cfg.grid_side, weight.device) for g in grids]
        index, weights = torch.cat([i for i, _ in taps]), torch.cat([w for _, w in taps])
        # As transformers: the taps' weighted sum in float32 (the table's dtype promoted).
        positions = (F.embedding(index, self.pos_table) * weights[:, :, None]).sum(1)
        x = x + positions.to(x.dtype)
        cos, sin = vision_rotary(b, grids, weight.device)
        lens = [h * w for t, h, w in grids for _ in range(t)]  # attention within each frame
        stacked = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, lens)
            if i in cfg.deepstack:
                stacked.append(self.deepstack[cfg.deepstack.index(i)](x))
        return torch.cat([self.merger(x), *stacked], dim=-1)

    def weight_specs(self, prefix: str, param: str) -> list[WeightSpec]:
        b = self.cfg.block
        d, c, t, p = b.embed_dim, b.in_channels, b.temporal_patch_size, b.patch_size
        specs = [
            WeightSpec(f"{prefix}.patch_embed.proj.weight", (d, c, t, p, p),
                       f"{param}.patch_weight"),
            WeightSpec(f"{prefix}.patch_embed.proj.bias", (d,), f"{param}.patch_bias"),
            WeightSpec(f"{prefix}.pos_embed.weight", (self.cfg.num_positions, d),
                       f"{param}.pos_table"),
        ]  # fmt: skip
        for i in range(b.depth):
            specs += _block_specs(b, f"{prefix}.blocks.{i}", f"{param}.blocks.{i}")
        specs += self.merger.specs(f"{prefix}.merger", f"{param}.merger")
        for j in range(len(self.cfg.deepstack)):
            merger = cast(Merger, self.deepstack[j])
            specs += merger.specs(f"{prefix}.deepstack_merger_list.{j}", f"{param}.deepstack.{j}")
        return specs


def _block_specs(cfg: VisionConfig, ckpt: str, param: str) -> list[WeightSpec]:
    """A block's tensors: Qwen2-VL's names, but the MLP's ``linear_fc1`` / ``linear_fc2``."""
    d, m = cfg.embed_dim, cfg.mlp_dim
    specs = [
        *linear_specs(f"{ckpt}.attn.qkv", f"{param}.qkv", 3 * d, d, True),
        *linear_specs(f"{ckpt}.attn.proj", f"{param}.proj", d, d, True),
        *linear_specs(f"{ckpt}.mlp.linear_fc1", f"{param}.fc1", m, d, True),
        *linear_specs(f"{ckpt}.mlp.linear_fc2", f"{param}.fc2", d, m, True),
    ]
    for norm in ("norm1", "norm2"):
        specs += [
            WeightSpec(f"{ckpt}.{norm}.weight", (d,), f"{param}.{norm}.weight"),
            WeightSpec(f"{ckpt}.{norm}.bias", (d,), f"{param}.{norm}.bias"),
        ]
    return specs
