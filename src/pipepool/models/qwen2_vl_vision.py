"""Qwen2-VL's vision tower (transformers' ``Qwen2VisionTransformerPretrainedModel``), run by
the first stage of a Qwen2-VL pipeline on the images of the requests a plan starts.

An image arrives as its patches' pixel values (``core/media.ImageInput``: the processor's
``pixel_values`` rows, ``channels x temporal_patch x patch x patch`` values each, ordered so
that each ``merge x merge`` block of patches is consecutive) and its patch grid. The patch
embedding (a Conv3d whose stride is its kernel) is a linear map of those values; each block
is pre-norm, bidirectional over one image's patches, with 2-D rotary positions (height, width
of each patch); the merger concatenates each block's ``merge**2`` patches and projects them
to the decoder's width: one row per image placeholder token."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..core.media import ImageInput
from ..errors import ModelLoadError
from ..layers.activation import get_activation
from .base import WeightSpec, linear_specs


@dataclass(frozen=True)
class VisionConfig:
    """A Qwen2-VL ``vision_config``."""

    depth: int
    embed_dim: int
    num_heads: int
    mlp_dim: int
    hidden_act: str
    out_dim: int  # the decoder's hidden size (the merger's output)
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    in_channels: int
    rope_theta: float

    @property
    def patch_values(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_hf(cls, vision: dict, out_dim: int) -> VisionConfig:
        act = vision.get("hidden_act", "quick_gelu")
        get_activation(act)  # refused at load time, not mid-request
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ModelLoadError(
                f"vision_config.rope_parameters.rope_type={rope['rope_type']!r} is not "
                "implemented (axial)"
            )
        embed, heads = int(vision.get("embed_dim", 1280)), int(vision.get("num_heads", 16))
        if embed % heads or (embed // heads) % 4:
            raise ModelLoadError(f"vision_config: embed_dim {embed} over {heads} heads")
        hidden = vision.get("hidden_size", out_dim)
        if hidden != out_dim:
            raise ModelLoadError(
                f"vision_config.hidden_size {hidden} differs from the decoder's {out_dim}"
            )
        return cls(
            depth=int(vision.get("depth", 32)), embed_dim=embed, num_heads=heads,
            mlp_dim=int(embed * vision.get("mlp_ratio", 4)), hidden_act=act, out_dim=out_dim,
            patch_size=int(vision.get("patch_size", 14)),
            temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
            merge_size=int(vision.get("spatial_merge_size", 2)),
            in_channels=int(vision.get("in_channels", 3)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )  # fmt: skip


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionBlock(nn.Module):
    """x += proj(attn(norm1(x))); x += fc2(act(fc1(norm2(x)))), attention within each image."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d = cfg.embed_dim
        self.num_heads = cfg.num_heads
        self.norm1 = nn.LayerNorm(d, eps=1e-6)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d, eps=1e-6)
        self.fc1 = nn.Linear(d, cfg.mlp_dim)
        self.fc2 = nn.Linear(cfg.mlp_dim, d)
        self.act = get_activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lens: list[int]):
        n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, 3, self.num_heads, -1).unbind(1)
        qf, kf = q.float(), k.float()  # transformers rotates in float32
        q = (qf * cos + _rotate_half(qf) * sin).to(q.dtype)
        k = (kf * cos + _rotate_half(kf) * sin).to(k.dtype)
        out = []
        for qi, ki, vi in zip(q.split(lens), k.split(lens), v.split(lens), strict=True):
            a = F.scaled_dot_product_attention(
                qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1)
            )
            out.append(a.transpose(0, 1).reshape(len(qi), d))
        x = x + self.proj(torch.cat(out))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))

    @staticmethod
    def specs(cfg: VisionConfig, ckpt: str, param: str) -> list[WeightSpec]:
        d, m = cfg.embed_dim, cfg.mlp_dim
        return [
            *linear_specs(f"{ckpt}.attn.qkv", f"{param}.qkv", 3 * d, d, True),
            *linear_specs(f"{ckpt}.attn.proj", f"{param}.proj", d, d, True),
            *linear_specs(f"{ckpt}.mlp.fc1", f"{param}.fc1", m, d, True),
            *linear_specs(f"{ckpt}.mlp.fc2", f"{param}.fc2", d, m, True),
            *_norm(f"{ckpt}.norm1", f"{param}.norm1", d),
            *_norm(f"{ckpt}.norm2", f"{param}.norm2", d),
        ]


def _norm(ckpt: str, param: str, dim: int) -> list[WeightSpec]:
    return [
        WeightSpec(f"{ckpt}.weight", (dim,), f"{param}.weight"),
        WeightSpec(f"{ckpt}.bias", (dim,), f"{param}.bias"),
    ]


class VisionTower(nn.Module):
    """Images in, one decoder-width row per placeholder token out (``encode``)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, merged = cfg.embed_dim, cfg.embed_dim * cfg.merge_size**2
        c, t, p = cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size
        self.patch_weight = nn.Parameter(torch.empty(d, c, t, p, p))  # the Conv3d's
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger_norm = nn.LayerNorm(d, eps=1e-6)
        self.merger_fc1 = nn.Linear(merged, merged)
        self.merger_fc2 = nn.Linear(merged, cfg.out_dim)

    def _rotary(self, grids: list[tuple[int, int, int]], device) -> tuple[torch.Tensor, ...]:
        """cos, sin ``[patches, 1, head_dim]`` (float32) of every image's patches, as
        transformers' ``get_vision_position_ids`` orders them (block-major per merge block)."""
        cfg = self.cfg
        m, spatial = cfg.merge_size, (cfg.embed_dim // cfg.num_heads) // 2
        inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device=device)
                               / spatial)
        )  # fmt: skip
        rows = []
        for t, h, w in grids:
            hpos, wpos = torch.meshgrid(
                torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij"
            )
            shape = (h // m, m, w // m, m)
            hpos = hpos.reshape(shape).transpose(1, 2).flatten()
            wpos = wpos.reshape(shape).transpose(1, 2).flatten()
            rows.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
        freqs = torch.cat(rows)[..., None].float() * inv_freq  # [N, 2, spatial / 2]
        hw = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        full = torch.cat([hw, hw], dim=-1)[:, None, :]
        return full.cos(), full.sin()

    def encode(self, images: list[ImageInput]) -> torch.Tensor:
        """``[sum of placeholder tokens, out_dim]``: each image's rows, in image order."""
        cfg = self.cfg
        weight = self.patch_weight
        pixels = torch.cat([torch.from_numpy(i.pixels) for i in images]).to(weight.device)
        x = F.linear(pixels.to(weight.dtype), weight.flatten(1))  # the Conv3d, patch by patch
        grids = [i.grid for i in images]
        cos, sin = self._rotary(grids, weight.device)
        # Each temporal frame of an image attends within itself (transformers' cu_seqlens).
        lens = [h * w for t, h, w in grids for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, lens)
        merged = self.merger_norm(x).view(-1, cfg.embed_dim * cfg.merge_size**2)
        return self.merger_fc2(F.gelu(self.merger_fc1(merged)))

    def weight_specs(self, prefix: str, param: str) -> list[WeightSpec]:
        cfg = self.cfg
        d, merged = cfg.embed_dim, cfg.embed_dim * cfg.merge_size**2
        c, t, p = cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size
        specs = [
            WeightSpec(
                f"{prefix}.patch_embed.proj.weight", (d, c, t, p, p), f"{param}.patch_weight"
            )
        ]
        for i in range(cfg.depth):
            specs += VisionBlock.specs(cfg, f"{prefix}.blocks.{i}", f"{param}.blocks.{i}")
        specs += _norm(f"{prefix}.merger.ln_q", f"{param}.merger_norm", d)
        specs += linear_specs(f"{prefix}.merger.mlp.0", f"{param}.merger_fc1", merged, merged, True)
        specs += linear_specs(
            f"{prefix}.merger.mlp.2", f"{param}.merger_fc2", cfg.out_dim, merged, True
        )
        return specs
