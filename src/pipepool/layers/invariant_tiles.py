"""Batch-invariant products from a vendor GEMM: the rows cut into tiles of a fixed height and
multiplied as a batch of ``[tile_rows, K] x [K, N]`` problems (``torch.bmm`` over the weight
expanded, no copy of it), so the library sees one problem shape whatever the step.

Why this is invariant, and what is checked rather than assumed: a GEMM library picks its kernel
from the problem's shape (and the batch count); at a fixed tile height the shape is fixed, and
a kernel that neither splits K by the row count nor shares a tile's K-range between thread
blocks (stream-K) computes each row of a tile with the same dot products in the same order
wherever the row sits. The library never promises that, so :func:`cuda_tiles_agree` verifies it
once per (K, N, dtype, device) before the first use: every batch count a launch may have gives
each tile the bits that tile gets alone, and a tile's rows permuted give its results permuted.
Every count from 1 to :data:`MAX_LAUNCH_TILES` is checked and a step launches no more tiles at
once, so no step meets a batch count the check has not seen. Where the check fails
the caller keeps its own kernel (``invariant_triton``) for that shape, for good: one decision
per shape, never per step.

Measured on one H100 (bf16, torch 2.11, 8,192 rows): at 256-row tiles cuBLAS ran the
Qwen3-0.6B layer shapes at 0.98-1.02x its own untiled speed, every check bit-equal; at 64-row
tiles it ran at 0.5-0.6x and one shape gave a row alone other bits than inside a batch
(docs/batch-invariance.md).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

# Rows per tile on CUDA: the smallest height at which cuBLAS ran every layer shape measured at
# its untiled speed.
CUDA_TILE_ROWS = 256
# Most tiles in one launch (16,384 rows); a step with more takes several launches.
MAX_LAUNCH_TILES = 64
# The dtypes the vendor GEMM runs here; fp32 (pooled heads) stays on the IEEE Triton kernel,
# since cuBLAS may multiply fp32 in TF32 where the process allows it.
TILED_DTYPES = (torch.bfloat16, torch.float16)

_agree: dict[tuple[int, int, torch.dtype, torch.device], bool] = {}
_lock = threading.Lock()


def launch_counts(tiles: int, max_tiles: int | None) -> list[int]:
    """``tiles`` as the batch counts of successive launches: all in one without a bound, else
    launches of ``max_tiles`` and one of the rest."""
    if max_tiles is None:
        return [tiles] if tiles else []
    full, rest = divmod(tiles, max_tiles)
    return [max_tiles] * full + ([rest] if rest else [])


def tiled_matmul(
    rows: torch.Tensor, b: torch.Tensor, tile_rows: int, max_tiles: int | None = None
) -> torch.Tensor:
    """``rows @ b`` for ``rows`` [M, K] and ``b`` [K, N] as tiles of ``tile_rows`` rows, in
    launches of :func:`launch_counts`, the last rows zero-padded to a tile of their own;
    [M, N] in ``rows``' dtype."""
    m, k = rows.shape
    n = b.shape[1]
    if not rows.is_contiguous():
        rows = rows.contiguous()
    full = m // tile_rows
    rest = m - full * tile_rows
    out = rows.new_empty((m if not rest else (full + 1) * tile_rows, n))
    first = 0
    for count in launch_counts(full, max_tiles):
        last = first + count * tile_rows
        torch.bmm(
            rows[first:last].view(count, tile_rows, k), b.expand(count, k, n),
            out=out[first:last].view(count, tile_rows, n),
        )  # fmt: skip
        first = last
    if rest:  # the last rows zero-padded to a tile, multiplied alone
        padded = F.pad(rows[first:], (0, 0, 0, tile_rows - rest))
        torch.bmm(padded[None], b[None], out=out[first:].view(1, tile_rows, n))
    return out[:m]


def cuda_tiles_agree(k: int, n: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :func:`tiled_matmul` at :data:`CUDA_TILE_ROWS` x :data:`MAX_LAUNCH_TILES` gives
    every row the same bits whatever its batch-mates, for products of ``[*, k] x [k, n]`` on
    ``device`` (checked once, then remembered; called outside CUDA graph capture)."""
    key = (k, n, dtype, torch.device(device))
    with _lock:
        if key not in _agree:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"the tiled GEMM of [*, {k}] x [{k}, {n}] ({dtype}) is first met inside a "
                    "CUDA graph capture: its check must run before (the capture's warm-up)"
                )
            _agree[key] = tiles_agree(k, n, dtype, torch.device(device), CUDA_TILE_ROWS,
                                      MAX_LAUNCH_TILES)  # fmt: skip
        return _agree[key]


def check_linears(model: nn.Module) -> None:
    """Make :func:`cuda_tiles_agree`'s check now for every linear layer of ``model`` on CUDA in
    a tiled dtype: at load, before the KV cache takes the memory its scratch needs (an 8B
    model's MLP: ~1 GB), rather than inside the first step."""
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        weight = module.weight
        if weight.is_cuda and weight.dtype in TILED_DTYPES:
            cuda_tiles_agree(weight.shape[1], weight.shape[0], weight.dtype, weight.device)


def tiles_agree(
    k: int, n: int, dtype: torch.dtype, device: torch.device, tile_rows: int, max_tiles: int
) -> bool:
    """The check behind :func:`cuda_tiles_agree`, on random inputs of a fixed seed: for every
    launch count from 1 to ``max_tiles``, each tile of a launch equals that tile multiplied
    alone, and a tile with its rows permuted gives its rows permuted."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(max_tiles, tile_rows, k, device=device, dtype=dtype, generator=gen)
    weight = torch.randn(n, k, device=device, dtype=dtype, generator=gen) / k**0.5
    b = weight.t()  # a weight's [K, N] view, as the layers pass it

    def alone(i: int) -> torch.Tensor:
        return torch.bmm(a[i : i + 1], b[None])

    with torch.inference_mode():
        perm = torch.randperm(tile_rows, device=device, generator=gen)
        if not torch.equal(torch.bmm(a[:1, perm], b[None]), alone(0)[:, perm]):
            return False
        # Each tile's alone product made again per count, so that the check holds no more
        # than one launch's output at a time (an 8B model's MLP: ~1 GB at 64 tiles).
        for count in range(2, max_tiles + 1):
            batch = torch.bmm(a[:count], b.expand(count, k, n))
            if not all(torch.equal(batch[i : i + 1], alone(i)) for i in range(count)):
                return False
    return True
