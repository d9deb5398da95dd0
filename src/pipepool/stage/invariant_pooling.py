"""Sum-based poolings of prompts that span several steps, chunk-invariant (batch_invariant).

By default a multi-chunk prompt's MEAN adds each chunk's sum to the running total, so the
chunk boundaries (which move with the batch and the token budget) decide how its rows are
associated. With ``batch_invariant`` the pooler keeps the chunk's (weighted) rows instead and
sums the whole prompt at its last chunk with the very computation a prompt that fits one step
gets (``whole_prompt_sum``): the same rows, summed in the same order, whatever the chunks.
Memory: one ``[prompt length, hidden]`` buffer per such prompt while it runs, as ALL pooling
keeps.
"""

from __future__ import annotations

import torch

from ..layers import segment_sum


def whole_prompt_sum(rows: torch.Tensor) -> torch.Tensor:
    """[L, H] rows -> [1, H] float32 sum, as ``Pooler.pool`` sums a prompt whole in one step:
    the segment-sum kernel where it runs (CUDA), else ``index_add_`` into a zero row (rows
    added one after the other)."""
    if segment_sum.supported(rows.device):
        bounds = torch.tensor([0, rows.shape[0]], dtype=torch.int64, device=rows.device)
        return segment_sum.segment_sums(rows, bounds)
    out = rows.new_zeros((1, rows.shape[1]), dtype=torch.float32)
    index = torch.zeros(rows.shape[0], dtype=torch.int64, device=rows.device)
    return out.index_add_(0, index, rows.float())


def keep_chunk(
    buffers: dict[int, torch.Tensor],
    request_id: int,
    chunk_rows: torch.Tensor,
    start: int,
    prompt_len: int,
) -> torch.Tensor | None:
    """Store one chunk's (weighted) rows at ``start`` of the request's prompt-sized buffer;
    the whole prompt's sum ([1, H] float32) once the buffer is full, else None."""
    if start == 0:
        buffers[request_id] = chunk_rows.new_empty((prompt_len, chunk_rows.shape[1]))
    end = start + chunk_rows.shape[0]
    buffers[request_id][start:end] = chunk_rows
    if end < prompt_len:
        return None
    return whole_prompt_sum(buffers.pop(request_id))
