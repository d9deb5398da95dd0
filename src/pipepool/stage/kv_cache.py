"""A stage's KV-cache tensors: one K and one V table per layer, rows addressed by flat slot
``block_id * block_size + offset`` (the scheduler's block ids are global to the pipeline)."""

from __future__ import annotations

import torch

from ..models import KVLayout


class KVCache:
    """One stage's paged KV cache: per layer, key and value rows of ``num_blocks`` blocks of
    ``block_size`` slots, written and read by the attention layers at the slots the step
    plan gives (never chosen by the stage itself)."""

    def __init__(
        self,
        layout: KVLayout,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        # torch.empty: on CPU untouched pages cost no memory; the slots a request uses are
        # always written before they are read (its own earlier chunks write them).
        self.storage = torch.empty(
            (num_layers, 2, self.num_slots, layout.num_kv_heads, layout.head_dim),
            dtype=dtype,
            device=device,
        )

    def layer(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of the stage's j-th layer, each [slots, num_kv_heads, head_dim]."""
        return self.storage[j, 0], self.storage[j, 1]

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.layer(j) for j in range(self.storage.shape[0])]
