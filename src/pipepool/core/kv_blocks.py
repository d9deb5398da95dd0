"""KV-cache block accounting on the driver (the tensors live in each stage's KVCache)."""

from __future__ import annotations

import numpy as np


class BlockAllocator:
    """A free list of block ids shared by every stage: stage k holds block b of request r for
    its own layers, so one id space serves the whole pipeline."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, num_tokens: int) -> np.ndarray | None:
        """Blocks for ``num_tokens`` tokens, or None (nothing taken) when too few are free."""
        n = self.blocks_for(num_tokens)
        if n > len(self._free):
            return None
        return np.array([self._free.pop() for _ in range(n)], dtype=np.int32)

    def free(self, block_ids: np.ndarray) -> None:
        self._free.extend(int(b) for b in block_ids[::-1])
        assert len(self._free) <= self.num_blocks, "a block was freed twice"
