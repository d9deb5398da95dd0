"""Rotary position embedding (RoPE), HF's non-interleaved "rotate half" layout."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import ModelLoadError


def rope_inv_freq(rot_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [rot_dim / 2], with the scaling schemes whose result does not depend
    on the sequence length (default, linear, llama3)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ModelLoadError(f"rope scaling {kind!r} is not supported (default, linear, llama3 are)")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k given each token's absolute position.

    cos/sin are tabulated once for every position up to ``max_positions`` (fp32), so a step
    only gathers rows: no per-step trigonometry, no host sync.
    """

    cos_sin: torch.Tensor  # buffer [max_pos, rot_dim]

    def __init__(
        self, head_dim: int, rot_dim: int, theta: float, scaling: dict | None, max_positions: int
    ) -> None:
        super().__init__()
        self.head_dim, self.rot_dim, self.max_positions = head_dim, rot_dim, max_positions
        self.theta, self.scaling = theta, scaling
        self.register_buffer("cos_sin", self._table(), persistent=False)  # [max_pos, rot_dim]

    def _table(self) -> torch.Tensor:
        inv_freq = rope_inv_freq(self.rot_dim, self.theta, self.scaling)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq)
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def reset_table(self) -> None:
        """Recompute the table in place (after the module was materialised from the meta device)."""
        self.cos_sin = self._table().to(self.cos_sin.device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(positions, q, k, self.cos_sin, self.rot_dim)


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, rot_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hkv, D], positions: [T]; cos_sin: [max_pos, rot_dim] table."""
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, rot/2] each
    return _rotate(q, cos, sin, rot_dim), _rotate(k, cos, sin, rot_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int) -> torch.Tensor:
    # Same arithmetic as HF's q*cos + rotate_half(q)*sin, with cos/sin cast to x's dtype first.
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out
