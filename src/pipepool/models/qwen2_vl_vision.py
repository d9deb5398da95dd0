"""Qwen2-VL's vision tower (transformers' ``Qwen2VisionTransformerPretrainedModel``) and
Qwen2.5-VL's (``Qwen2_5_VisionTransformerPretrainedModel``), run by the first stage of their
pipelines on the images of the requests a plan starts.

An image arrives as its patches' pixel values (``core/media.ImageInput``: the processor's
``pixel_values`` rows, ``channels x temporal_patch x patch x patch`` values each, ordered so
that each ``merge x merge`` block of patches is consecutive) and its patch grid. The patch
embedding (a Conv3d whose stride is its kernel) is a linear map of those values; each block
is pre-norm, bidirectional over one image's patches, with 2-D rotary positions (height, width
of each patch); the merger concatenates each block's ``merge**2`` patches and projects them
to the decoder's width: one row per image placeholder token.

Qwen2.5-VL's differs in three ways: RMSNorm instead of LayerNorm (blocks and merger), a gated
MLP (``gate_proj``, ``up_proj``, ``down_proj``), and windowed attention: its patches are
reordered merge block by merge block into windows of ``window_size`` pixels, every block but
``fullatt_block_indexes`` attends within its window only, and the merger's rows are put back
in the image's order."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..core.media import ImageInput
from ..errors import ModelLoadError
from ..layers.activation import get_activation
from ..layers.norm import RMSNorm
from .base import WeightSpec, linear_specs


@dataclass(frozen=True)
class VisionConfig:
    """A Qwen2-VL or Qwen2.5-VL ``vision_config`` (``windowed``: Qwen2.5-VL's tower)."""

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
    windowed: bool = False  # Qwen2.5-VL: RMSNorm, gated MLP, windowed attention
    window_size: int = 0  # pixels on a window's side
    full_blocks: tuple[int, ...] = ()  # blocks attending over the whole image

    @property
    def patch_values(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_hf(cls, vision: dict, out_dim: int, *, windowed: bool = False) -> VisionConfig:
        act = vision.get("hidden_act", "silu" if windowed else "quick_gelu")
        get_activation(act)  # refused at load time, not mid-request
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ModelLoadError(
                f"vision_config.rope_parameters.rope_type={rope['rope_type']!r} is not "
                "implemented (axial)"
            )
        # Qwen2.5-VL names the tower's width hidden_size and its output out_hidden_size.
        embed = int(vision.get("hidden_size" if windowed else "embed_dim", 1280))
        heads = int(vision.get("num_heads", 16))
        if embed % heads or (embed // heads) % 4:
            raise ModelLoadError(f"vision_config: width {embed} over {heads} heads")
        out = vision.get("out_hidden_size" if windowed else "hidden_size", out_dim)
        if out != out_dim:
            raise ModelLoadError(
                f"vision_config: the merger's output {out} differs from the decoder's {out_dim}"
            )
        mlp = (
            int(vision.get("intermediate_size", 3420))
            if windowed
            else int(embed * vision.get("mlp_ratio", 4))
        )
        return cls(
            depth=int(vision.get("depth", 32)), embed_dim=embed, num_heads=heads,
            mlp_dim=mlp, hidden_act=act, out_dim=out_dim,
            patch_size=int(vision.get("patch_size", 14)),
            temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
            merge_size=int(vision.get("spatial_merge_size", 2)),
            in_channels=int(vision.get("in_channels", 3)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            windowed=windowed, window_size=int(vision.get("window_size", 112)) if windowed else 0,
            full_blocks=tuple(int(i) for i in vision.get("fullatt_block_indexes", ()))
            if windowed else (),
        )  # fmt: skip


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionBlock(nn.Module):
    """x += proj(attn(norm1(x))); x += fc2(act(fc1(norm2(x)))), attention within each image."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d = cfg.embed_dim
        self.num_heads, self.gated = cfg.num_heads, cfg.windowed
        self.scale = (d // cfg.num_heads) ** -0.5  # transformers' scaling
        self.norm1, self.norm2 = _norm_module(cfg), _norm_module(cfg)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        # fc1: gate|up of Qwen2.5-VL's gated MLP, fused; fc2: its down projection.
        self.fc1 = nn.Linear(d, cfg.mlp_dim * (2 if cfg.windowed else 1))
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
            # [1, H, L, D], as transformers calls it: on the CPU a 3-D call takes the math
            # path (fp32 probabilities), a 4-D one the flash kernel transformers' bf16 runs.
            qb, kb, vb = (t.transpose(0, 1)[None] for t in (qi, ki, vi))
            a = F.scaled_dot_product_attention(qb, kb, vb, scale=self.scale)[0]
            out.append(a.transpose(0, 1).reshape(len(qi), d))
        x = x + self.proj(torch.cat(out))
        h = self.fc1(self.norm2(x))
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            return x + self.fc2(self.act(gate) * up)
        return x + self.fc2(self.act(h))

    @staticmethod
    def specs(cfg: VisionConfig, ckpt: str, param: str) -> list[WeightSpec]:
        d, m = cfg.embed_dim, cfg.mlp_dim
        if cfg.windowed:
            mlp = [
                *linear_specs(f"{ckpt}.mlp.gate_proj", f"{param}.fc1", m, d, True, (0, m)),
                *linear_specs(f"{ckpt}.mlp.up_proj", f"{param}.fc1", m, d, True, (m, 2 * m)),
                *linear_specs(f"{ckpt}.mlp.down_proj", f"{param}.fc2", d, m, True),
            ]
        else:
            mlp = [
                *linear_specs(f"{ckpt}.mlp.fc1", f"{param}.fc1", m, d, True),
                *linear_specs(f"{ckpt}.mlp.fc2", f"{param}.fc2", d, m, True),
            ]
        return [
            *linear_specs(f"{ckpt}.attn.qkv", f"{param}.qkv", 3 * d, d, True),
            *linear_specs(f"{ckpt}.attn.proj", f"{param}.proj", d, d, True),
            *mlp,
            *_norm(cfg, f"{ckpt}.norm1", f"{param}.norm1", d),
            *_norm(cfg, f"{ckpt}.norm2", f"{param}.norm2", d),
        ]


def _norm_module(cfg: VisionConfig) -> nn.Module:
    return RMSNorm(cfg.embed_dim, 1e-6) if cfg.windowed else nn.LayerNorm(cfg.embed_dim, eps=1e-6)


def _norm(cfg: VisionConfig, ckpt: str, param: str, dim: int) -> list[WeightSpec]:
    specs = [WeightSpec(f"{ckpt}.weight", (dim,), f"{param}.weight")]
    if not cfg.windowed:  # Qwen2.5-VL's RMSNorm has no bias
        specs.append(WeightSpec(f"{ckpt}.bias", (dim,), f"{param}.bias"))
    return specs


def window_order(grids: list[tuple[int, int, int]], merge: int, window: int):
    """transformers' ``get_vision_window_index``: the merge blocks of every image in window
    order (``[blocks]``) and the windows' lengths in patches."""
    per_side = window // merge
    order, lens, first = [], [], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = per_side - gh % per_side, per_side - gw % per_side
        padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
        nh, nw = (gh + pad_h) // per_side, (gw + pad_w) // per_side
        padded = padded.reshape(t, nh, per_side, nw, per_side).permute(0, 1, 3, 2, 4)
        padded = padded.reshape(t, nh * nw, per_side * per_side)
        counts = (padded != -100).sum(-1).reshape(-1)
        flat = padded.reshape(-1)
        order.append(flat[flat != -100] + first)
        lens += [int(c) * merge * merge for c in counts.tolist() if c]
        first += t * gh * gw
    return torch.cat(order), lens


def vision_rotary(cfg: VisionConfig, grids: list[tuple[int, int, int]], device):
    """cos, sin ``[patches, 1, head_dim]`` (float32) of every image's patches, as
    transformers' ``get_vision_position_ids`` orders them (block-major per merge block): the
    2-D rotary positions of Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's towers."""
    m, spatial = cfg.merge_size, (cfg.embed_dim // cfg.num_heads) // 2
    inv_freq = 1.0 / (
        cfg.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device=device) / spatial)
    )
    rows = []
    for t, h, w in grids:
        hpos, wpos = block_major(h, w, m, device)
        rows.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
    freqs = torch.cat(rows)[..., None].float() * inv_freq  # [N, 2, spatial / 2]
    hw = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
    full = torch.cat([hw, hw], dim=-1)[:, None, :]
    return full.cos(), full.sin()


def block_major(h: int, w: int, merge: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each patch of an ``h x w`` grid, merge block by merge block (the
    order of the processor's patches)."""
    hpos, wpos = torch.meshgrid(
        torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij"
    )
    shape = (h // merge, merge, w // merge, merge)
    rows = hpos.reshape(shape).transpose(1, 2).flatten()
    cols = wpos.reshape(shape).transpose(1, 2).flatten()
    return rows, cols


class VisionTower(nn.Module):
    """Images in, one decoder-width row per placeholder token out (``encode``)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, merged = cfg.embed_dim, cfg.embed_dim * cfg.merge_size**2
        c, t, p = cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size
        self.patch_weight = nn.Parameter(torch.empty(d, c, t, p, p))  # the Conv3d's
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger_norm = _norm_module(cfg)
        self.merger_fc1 = nn.Linear(merged, merged)
        self.merger_fc2 = nn.Linear(merged, cfg.out_dim)

    def encode(self, images: list[ImageInput]) -> torch.Tensor:
        """``[sum of placeholder tokens, out_dim]``: each image's rows, in image order."""
        cfg = self.cfg
        weight = self.patch_weight
        pixels = pixel_rows(images, weight.device)
        x = F.linear(pixels.to(weight.dtype), weight.flatten(1))  # the Conv3d, patch by patch
        grids = [i.grid for i in images]
        cos, sin = vision_rotary(cfg, grids, weight.device)
        # Each temporal frame of an image attends within itself (transformers' cu_seqlens).
        full = [h * w for t, h, w in grids for _ in range(t)]
        lens, order = full, None
        if cfg.windowed:  # merge blocks in window order; most blocks attend per window
            order, lens = window_order(grids, cfg.merge_size, cfg.window_size // cfg.patch_size)
            unit = cfg.merge_size**2
            x, cos, sin = (_by_blocks(a, order.to(a.device), unit) for a in (x, cos, sin))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full if i in cfg.full_blocks else lens)
        merged = self.merger_norm(x).view(-1, cfg.embed_dim * cfg.merge_size**2)
        out = self.merger_fc2(F.gelu(self.merger_fc1(merged)))
        return out if order is None else out[torch.argsort(order).to(out.device)]

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
        specs += _norm(cfg, f"{prefix}.merger.ln_q", f"{param}.merger_norm", d)
        specs += linear_specs(f"{prefix}.merger.mlp.0", f"{param}.merger_fc1", merged, merged, True)
        specs += linear_specs(
            f"{prefix}.merger.mlp.2", f"{param}.merger_fc2", cfg.out_dim, merged, True
        )
        return specs


def pixel_rows(images: list[ImageInput], device: torch.device) -> torch.Tensor:
    """The images' patch rows, back to back, on ``device``: each image copied on its own and
    joined there (joining on the host first copied every row twice)."""
    return torch.cat([torch.from_numpy(i.pixels).to(device) for i in images])


def _by_blocks(a: torch.Tensor, order: torch.Tensor, unit: int) -> torch.Tensor:
    """Rows of ``a`` reordered merge block by merge block (``unit`` rows a block)."""
    return a.reshape(-1, unit, *a.shape[1:])[order].reshape(a.shape)
