"""The vision tower of CLIP / SigLIP / SigLIP2 (``towers.py`` holds the shared layers).

An image is a prompt of fixed length: one row per patch (CLIP adds its class token as row 0).
The first stage receives each row's pixel values, not a token id: the plan's token ids of a
vision step are a 2-D int64 array, one row per position, holding that patch's float32 pixel
values (``intake/images.py`` packs them, two to an int64; CLIP's class-token row is zeros), so
the scheduler, the mirror and the digest count an image's rows exactly as they count tokens.
The patch embedding (a convolution of stride ``patch_size``) is a linear map of those values.

The last stage applies ``post_layernorm`` and pools as transformers does: CLIP reads row 0
(the class token) and projects it (``visual_projection``); SigLIP pools the whole image with
its attention head (``vision_model.head``: a learned probe attends over every patch) and writes
that vector into the image's row 0, which the pooler reads (pooling ``cls``). Images never
split across steps (the tower is bidirectional), so each step holds whole images."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..layers.activation import get_activation
from .base import StepInputs, WeightSpec, embedding, linear_specs
from .towers import TowerConfig, TowerStage, norm_specs


def patch_row_width(cfg: TowerConfig) -> int:
    """int64 columns of one position's row in a vision plan: a patch's float32 pixel values
    (SigLIP2: then its image's patch-grid height and width), two to a column."""
    return -(-(cfg.patch_values + 2 * cfg.naflex) // 2)


def resized_positions(table: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """SigLIP2's square position table [side * side, H] resized to a ``height x width`` patch
    grid -> [height * width, H], row-major: transformers' ``resize_positional_embeddings``
    (bilinear, antialiased, float32 on the CPU where torch has no antialiased bf16)."""
    side = round(table.shape[0] ** 0.5)
    grid = table.reshape(side, side, -1).permute(2, 0, 1).unsqueeze(0)
    if grid.device.type == "cpu":
        grid = grid.float()
    grid = F.interpolate(
        grid, size=(height, width), mode="bilinear", align_corners=False, antialias=True
    )
    return grid.reshape(table.shape[1], height * width).t().to(table.dtype)


class AttentionPoolingHead(nn.Module):
    """SigLIP's ``SiglipMultiheadAttentionPoolingHead``: a learned probe attends over an
    image's patches (``nn.MultiheadAttention``), then ``x + mlp(layernorm(x))``."""

    def __init__(self, cfg: TowerConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.probe = nn.Parameter(torch.empty(1, 1, h))
        self.in_proj = nn.Linear(h, 3 * h)
        self.out_proj = nn.Linear(h, h)
        self.norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(h, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, h)
        self.act = get_activation(cfg.hidden_act)

    def forward(self, images: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, N, H] -> [B, H]; ``mask`` [B, N] (True: a row of the image) for images of
        several lengths padded to N."""
        b, n, h = images.shape
        d = h // self.num_heads
        wq, wk, wv = self.in_proj.weight.chunk(3)
        bq, bk, bv = self.in_proj.bias.chunk(3)
        q = F.linear(self.probe[0], wq, bq).view(1, self.num_heads, 1, d).expand(b, -1, -1, -1)
        k = F.linear(images, wk, bk).view(b, n, self.num_heads, d).transpose(1, 2)
        v = F.linear(images, wv, bv).view(b, n, self.num_heads, d).transpose(1, 2)
        keep = None if mask is None else mask[:, None, None, :]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(b, h)
        x = self.out_proj(a)
        return x + self.fc2(self.act(self.fc1(self.norm(x))))

    @staticmethod
    def specs(cfg: TowerConfig, ckpt: str, param: str) -> list[WeightSpec]:
        h, inter = cfg.hidden_size, cfg.intermediate_size
        return [
            WeightSpec(f"{ckpt}.probe", (1, 1, h), f"{param}.probe"),
            WeightSpec(f"{ckpt}.attention.in_proj_weight", (3 * h, h), f"{param}.in_proj.weight"),
            WeightSpec(f"{ckpt}.attention.in_proj_bias", (3 * h,), f"{param}.in_proj.bias"),
            *linear_specs(f"{ckpt}.attention.out_proj", f"{param}.out_proj", h, h, True),
            *norm_specs(f"{ckpt}.layernorm", f"{param}.norm", h),
            *linear_specs(f"{ckpt}.mlp.fc1", f"{param}.fc1", inter, h, True),
            *linear_specs(f"{ckpt}.mlp.fc2", f"{param}.fc2", h, inter, True),
        ]


class VisionStage(TowerStage):
    """A slice of a vision tower: the first stage embeds patch rows, the last pools."""

    @property
    def prefix(self) -> str:
        return "vision_model"

    def _init_embeddings(self) -> None:
        cfg, h = self.cfg, self.cfg.hidden_size
        c, p = cfg.num_channels, cfg.patch_size
        shape = (h, cfg.patch_values) if cfg.naflex else (h, c, p, p)
        self.patch_weight = nn.Parameter(torch.empty(shape))
        self.patch_bias = nn.Parameter(torch.empty(h)) if cfg.kind != "clip" else None
        self.class_embedding = nn.Parameter(torch.empty(h)) if cfg.class_token else None
        self.position_embedding = embedding(cfg.max_positions, h)
        self.pre_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps) if cfg.class_token else None

    def __init__(self, cfg: TowerConfig, layers, first, last, max_len, head=None) -> None:
        super().__init__(cfg, layers, first, last, max_len, head)
        self.pool_head = AttentionPoolingHead(cfg) if last and cfg.attention_pooling else None

    def _embed(self, x: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        cfg = self.cfg
        rows = x.view(len(inputs.positions), patch_row_width(cfg)).view(torch.float32)
        pixels = rows[:, : cfg.patch_values].to(self.patch_weight.dtype)
        weight = self.patch_weight.flatten(1)  # the convolution, as a map of one patch's values
        e = F.linear(pixels, weight, self.patch_bias)
        if self.class_embedding is not None:  # row 0 of each image is its class token
            first = (inputs.positions == 0).unsqueeze(1)
            e = torch.where(first, self.class_embedding.to(e.dtype), e)
        if cfg.naflex:
            grids = rows[:, cfg.patch_values : cfg.patch_values + 2]
            return e + self._grid_positions(grids, inputs.positions).to(e.dtype)
        e = e + self.position_embedding(inputs.positions)
        return self.pre_norm(e) if self.pre_norm is not None else e

    def _grid_positions(self, grids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each row's position embedding from its image's resized table (one resize per
        distinct grid in the step)."""
        table = self.position_embedding.weight
        out = table.new_empty((len(positions), table.shape[1]))
        shapes = grids.to(torch.int64)
        for height, width in torch.unique(shapes, dim=0).tolist():
            rows = ((shapes[:, 0] == height) & (shapes[:, 1] == width)).nonzero().squeeze(1)
            out[rows] = resized_positions(table, height, width)[positions[rows]]
        return out

    def _finish(self, x: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        x = self.final_norm(x)
        if self.pool_head is not None:
            starts = inputs.attn.cu_q_host[:-1]
            lengths = np.diff(inputs.attn.cu_q_host)
            if self.cfg.naflex:
                pooled = self._pool_images(x, starts, lengths)
            else:
                n = self.cfg.max_positions
                assert bool((lengths == n).all()), "whole images only"
                pooled = self.pool_head(x.view(-1, n, x.shape[1]))
            x = x.clone()
            x[torch.from_numpy(starts).to(x.device)] = pooled.to(x.dtype)
        return self.projection(x) if self.projection is not None else x

    def _pool_images(self, x: torch.Tensor, starts: np.ndarray, lengths: np.ndarray):
        """The attention head over images of their own lengths, padded to the longest and
        masked (a masked row has weight exactly zero)."""
        longest = int(lengths.max())
        offsets = np.arange(longest)[None, :]
        mask = offsets < lengths[:, None]
        rows = np.where(mask, starts[:, None] + offsets, starts[:, None])
        index, keep = torch.from_numpy(rows).to(x.device), torch.from_numpy(mask).to(x.device)
        assert self.pool_head is not None
        return self.pool_head(x[index], keep)

    def _embedding_specs(self) -> list[WeightSpec]:
        cfg, h, p = self.cfg, self.cfg.hidden_size, "vision_model.embeddings"
        c, k = cfg.num_channels, cfg.patch_size
        patch_shape = (h, cfg.patch_values) if cfg.naflex else (h, c, k, k)
        specs = [
            WeightSpec(f"{p}.patch_embedding.weight", patch_shape, "patch_weight"),
            WeightSpec(
                f"{p}.position_embedding.weight", (cfg.max_positions, h),
                "position_embedding.weight",
            ),
        ]  # fmt: skip
        if self.patch_bias is not None:
            specs.append(WeightSpec(f"{p}.patch_embedding.bias", (h,), "patch_bias"))
        if self.class_embedding is not None:
            specs.append(WeightSpec(f"{p}.class_embedding", (h,), "class_embedding"))
        if self.pre_norm is not None:
            specs += norm_specs("vision_model.pre_layrnorm", "pre_norm", h)
        return specs

    def _final_specs(self) -> list[WeightSpec]:
        specs = norm_specs("vision_model.post_layernorm", "final_norm", self.cfg.hidden_size)
        if self.pool_head is not None:
            specs += AttentionPoolingHead.specs(self.cfg, "vision_model.head", "pool_head")
        return specs

    def _projection_name(self) -> str:
        return "visual_projection"
