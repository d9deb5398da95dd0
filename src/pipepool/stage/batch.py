"""From a step plan and a stage's mirror to the packed model inputs of one step.

All index arrays are built with vectorised numpy (nothing loops over tokens) and reach the
device in a single host->device copy through a reused pinned staging buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core.plan import StepPlan
from ..layers.attention import AttentionMetadata, prefix_key_rows
from ..layers.triton_attention import work_list
from ..models import StepInputs


@dataclass
class HostBatch:
    """One step's inputs on the host; every array is derived from chunk starts and lengths."""

    starts: np.ndarray  # [R] chunk start of each request (from the stage's mirror)
    lens: np.ndarray  # [R] chunk length
    cu_q: np.ndarray  # [R+1] row offsets in the packed batch
    cu_k: np.ndarray  # [R+1] offsets in packed K/V (== cu_q when no request has a prefix)
    positions: np.ndarray  # [T]
    write_rows: np.ndarray | None  # rows whose K/V later chunks read
    write_slots: np.ndarray | None
    chunk_dst: np.ndarray | None  # [T] rows of packed K/V holding this step's K/V
    prefix_dst: np.ndarray | None
    prefix_slots: np.ndarray | None
    # Bidirectional steps with key lengths: the rows of this step's K/V that are keys (cu_k
    # then counts them); None: every row is a key.
    key_rows: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.cu_q[-1])


def build_host_batch(
    starts: np.ndarray,
    lens: np.ndarray,
    prompt_lens: np.ndarray,
    kv_rows: np.ndarray | None,
    block_tables: list[np.ndarray],
    block_size: int,
    key_lens: np.ndarray | None = None,
) -> HostBatch:
    """``kv_rows``: the requests holding KV blocks (prompts spanning several steps), with
    ``block_tables`` in the same order; None for encoders (no KV cache, whole prompts).
    ``key_lens`` ([R], ``step_key_lens``): whole bidirectional prompts whose keys are their
    first ``key_lens`` tokens; None where every token is a key."""
    num_reqs = len(lens)
    cu_q = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(lens, out=cu_q[1:])
    # Row t of request r sits at position starts[r] + (t - cu_q[r]): one repeat, no gathers.
    positions = np.arange(cu_q[-1], dtype=np.int64) - np.repeat(cu_q[:-1] - starts, lens)
    batch = HostBatch(starts, lens, cu_q, cu_q, positions, None, None, None, None, None)
    if key_lens is not None:
        assert kv_rows is None or not len(kv_rows), "key lengths: whole prompts, no KV cache"
        assert not starts.any() and bool((key_lens <= lens).all()), "key lengths: whole prompts"
        batch.cu_k, batch.key_rows = prefix_key_rows(cu_q, key_lens)
    if kv_rows is None or not len(kv_rows):
        return batch
    row_req = np.repeat(np.arange(num_reqs), lens)  # [T] request index of each row
    table = _padded_table(block_tables)
    kv_index = np.full(num_reqs, -1, dtype=np.int64)  # request -> row of `table`
    kv_index[kv_rows] = np.arange(len(kv_rows))

    ends = starts + lens
    writes = np.nonzero((ends < prompt_lens)[row_req])[0]  # rows of non-final chunks
    if len(writes):
        batch.write_rows = writes
        batch.write_slots = _slots(table, kv_index[row_req[writes]], positions[writes], block_size)

    if (starts > 0).any():
        cu_k = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(ends, out=cu_k[1:])
        batch.cu_k = cu_k
        batch.chunk_dst = cu_k[row_req] + positions
        prefix_req = np.repeat(np.arange(num_reqs), starts)  # one entry per cached key
        cu_p = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(starts, out=cu_p[1:])
        prefix_pos = np.arange(cu_p[-1], dtype=np.int64) - cu_p[prefix_req]
        batch.prefix_dst = cu_k[prefix_req] + prefix_pos
        batch.prefix_slots = _slots(table, kv_index[prefix_req], prefix_pos, block_size)
    return batch


def step_key_lens(plan: StepPlan, lens: np.ndarray) -> np.ndarray | None:
    """Keys of each of the plan's requests (``lens``: their chunk lengths), where some new
    request keys only a prefix of its tokens (``NewRequests.key_lens``); else None, and the
    step is built exactly as without key lengths."""
    new = plan.new
    if not new.has_key_lens:
        return None
    keys = lens.copy()
    tail = keys[len(keys) - len(new) :]
    tail[:] = np.where(new.key_lens > 0, new.key_lens, tail)
    return keys


def _padded_table(block_tables: list[np.ndarray]) -> np.ndarray:
    width = max((len(t) for t in block_tables), default=0)
    table = np.zeros((len(block_tables), max(width, 1)), dtype=np.int64)
    for i, t in enumerate(block_tables):
        table[i, : len(t)] = t
    return table


def _slots(table: np.ndarray, kv: np.ndarray, pos: np.ndarray, block_size: int) -> np.ndarray:
    """Flat cache slots of positions ``pos`` of the requests at rows ``kv`` of ``table``."""
    assert (kv >= 0).all(), "a chunk reads or writes the KV cache without blocks"
    return table[kv, pos // block_size] * block_size + pos % block_size


class DeviceUploader:
    """Copies a step's int64 arrays to the device in one transfer.

    On CUDA the arrays are packed into a pinned staging buffer and copied asynchronously; two
    staging buffers alternate, and a buffer is refilled only after its previous copy finished,
    so the host can prepare step k+1 while the device still runs step k.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._staging: list[torch.Tensor | None] = [None, None]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def upload(self, arrays: list[np.ndarray | None]) -> list[torch.Tensor | None]:
        present = [a for a in arrays if a is not None]
        sizes = [len(a) for a in present]
        if self.device.type == "cuda":
            flat = self._copy_cuda(present, sum(sizes))
        elif present:
            flat = torch.from_numpy(np.concatenate(present).astype(np.int64, copy=False))
        else:
            flat = torch.empty(0, dtype=torch.int64)
        views = iter(torch.split(flat, sizes)) if present else iter(())
        return [next(views) if a is not None else None for a in arrays]

    def _copy_cuda(self, arrays: list[np.ndarray], total: int) -> torch.Tensor:
        turn = self._turn
        self._turn ^= 1
        staging, event = self._staging[turn], self._events[turn]
        if event is not None:
            event.synchronize()  # the copy that last used this buffer has finished
        if staging is None or staging.numel() < total:
            staging = torch.empty(max(total, 1 << 16), dtype=torch.int64, pin_memory=True)
            self._staging[turn] = staging
        if arrays:  # packed straight into the pinned buffer: no intermediate array
            np.concatenate(arrays, out=staging[:total].numpy())
        flat = staging[:total].to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events[turn] = event
        return flat


def to_step_inputs(
    batch: HostBatch,
    uploader: DeviceUploader,
    *,
    causal: bool,
    extra: list[np.ndarray | None],
    attn_block_rows: int | None = None,
) -> tuple[StepInputs, list[torch.Tensor | None]]:
    """Device tensors for the model; ``extra`` arrays (e.g. token ids) ride in the same copy.
    ``attn_block_rows``: the Triton attention kernel's BLOCK_M where the stage runs it from a
    work list (encoders: the list rides along too), else None."""
    work = work_list(batch.cu_q, attn_block_rows) if attn_block_rows else None
    tensors = uploader.upload(
        [
            work,
            batch.positions,
            batch.cu_q,
            batch.cu_k if batch.cu_k is not batch.cu_q else None,
            batch.write_rows,
            batch.write_slots,
            batch.chunk_dst,
            batch.prefix_dst,
            batch.prefix_slots,
            batch.key_rows,
            *extra,
        ]
    )
    work_t, positions, cu_q, cu_k, write_rows, write_slots, chunk_dst, prefix_dst, prefix_slots = (
        tensors[:9]
    )
    key_rows = tensors[9]
    assert positions is not None and cu_q is not None  # uploaded for every step
    cu_q32 = cu_q.to(torch.int32)
    cu_k32 = cu_k.to(torch.int32) if cu_k is not None else cu_q32
    has_prefix = batch.chunk_dst is not None
    if key_rows is not None:
        max_k = int(np.diff(batch.cu_k).max(initial=0))
    elif has_prefix:
        max_k = int((batch.starts + batch.lens).max())
    else:
        max_k = int(batch.lens.max(initial=0))
    meta = AttentionMetadata(
        causal=causal,
        cu_seqlens_q=cu_q32,
        cu_seqlens_k=cu_k32,
        max_q=int(batch.lens.max()) if len(batch.lens) else 0,
        max_k=max_k,
        cu_q_host=batch.cu_q,
        cu_k_host=batch.cu_k,
        write_rows=write_rows,
        write_slots=write_slots,
        chunk_dst=chunk_dst,
        prefix_dst=prefix_dst,
        prefix_slots=prefix_slots,
        total_k=int(batch.cu_k[-1]),
        work=work_t,
        work_programs=int(work[0]) if work is not None else 0,
        key_rows=key_rows,
    )
    return StepInputs(positions=positions, attn=meta), tensors[10:]
