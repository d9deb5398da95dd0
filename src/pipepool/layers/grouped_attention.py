"""CPU attention over groups of consecutive equal-length requests, as views of the packed batch.

PyTorch's CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``) runs only on 4-D
``[B, H, L, D]`` inputs; one 3-D call per request falls back to the math path (explicit score
matrices, softmax, many copies). Consecutive requests with the same query and key lengths
are already laid out as ``[B, L, H, D]`` in the packed batch, so such a run attends in one
kernel call on strided views: nothing is gathered, and the outputs concatenate back into
packed order. The encoder stage sorts a step's requests by length (models/bert.py), which
turns a step into a few long runs; an unsorted step simply has more, shorter runs.

The kernel is markedly slower when the key length is not a multiple of 16 (measured on
torch 2.13, fp32, 2 Sapphire Rapids cores: 2.7 vs 1.2 us per token and layer at 30 keys, head
dim 32), so keys are padded up to one: the view reads on into the next rows of the packed
K/V, which belong to the next request and are masked out. A run whose padding would read past
the last row leaves its final request unpadded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

KEY_ALIGN = 16


@dataclass(frozen=True)
class Run:
    """``size`` consecutive requests, each ``len_q`` queries at the end of ``len_k`` keys."""

    q_row: int  # first row of the run in q
    k_row: int  # first row of the run in the packed K/V
    size: int
    len_q: int
    len_k: int


@dataclass
class GroupPlan:
    """A step's runs (in packed order); planned once per step and shared by every layer."""

    runs: list[Run]
    causal: bool
    total_k: int  # rows of the packed K/V
    _masks: dict[tuple, torch.Tensor | None] = field(default_factory=dict)

    def mask(
        self, len_q: int, len_k: int, padded_k: int, window: int | None, device: torch.device
    ) -> torch.Tensor | None:
        """[len_q or 1, padded_k] boolean (True = may attend), None when nothing is masked."""
        key = (len_q, len_k, padded_k, window)
        if key not in self._masks:
            self._masks[key] = _make_mask(len_q, len_k, padded_k, self.causal, window, device)
        return self._masks[key]


def plan_runs(cu_q: np.ndarray, cu_k: np.ndarray, causal: bool) -> GroupPlan:
    """Cut the step into maximal runs of consecutive requests with equal (len_q, len_k)."""
    lq, lk = np.diff(cu_q), np.diff(cu_k)
    change = np.flatnonzero((lq[1:] != lq[:-1]) | (lk[1:] != lk[:-1])) + 1
    starts = np.concatenate(([0], change)).astype(np.int64)
    sizes = np.diff(np.concatenate((starts, [len(lq)])))
    runs = [
        Run(int(cu_q[s]), int(cu_k[s]), int(n), int(lq[s]), int(lk[s]))
        for s, n in zip(starts.tolist(), sizes.tolist(), strict=True)
        if len(lq)
    ]
    return GroupPlan(runs, causal, int(cu_k[-1]))


def _make_mask(
    len_q: int, len_k: int, padded_k: int, causal: bool, window: int | None, device: torch.device
) -> torch.Tensor | None:
    k_pos = torch.arange(padded_k, device=device)[None, :]
    if not causal:
        return None if padded_k == len_k else k_pos < len_k
    q_pos = torch.arange(len_k - len_q, len_k, device=device)[:, None]  # bottom-right aligned
    mask = (k_pos <= q_pos) & (k_pos < len_k)
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: GroupPlan,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """q: [T, Hq, D]; k/v: [total_k, Hkv, D] packed per request (may be strided views of one
    fused projection) -> [T, Hq, D] contiguous."""
    outs = []
    for run in plan.runs:
        # Padding could read past the last K/V row: attend the run's last request on its own.
        last_row = run.k_row + (run.size - 1) * run.len_k + _aligned(run.len_k)
        if run.size > 1 and last_row > plan.total_k:
            head = Run(run.q_row, run.k_row, run.size - 1, run.len_q, run.len_k)
            tail = Run(
                run.q_row + head.size * run.len_q, run.k_row + head.size * run.len_k, 1,
                run.len_q, run.len_k,
            )  # fmt: skip
            outs += [_attend_run(q, k, v, plan, r, scale, window) for r in (head, tail)]
        else:
            outs.append(_attend_run(q, k, v, plan, run, scale, window))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _aligned(n: int) -> int:
    return -(-n // KEY_ALIGN) * KEY_ALIGN


def _attend_run(q, k, v, plan: GroupPlan, run: Run, scale: float, window: int | None):
    n, lq, lk = run.size, run.len_q, run.len_k
    hq, d = q.shape[1], q.shape[2]
    square_causal = plan.causal and lq == lk and window is None
    padded = lk if square_causal else _aligned(lk)
    if run.k_row + (n - 1) * lk + padded > plan.total_k:
        padded = lk
    qg = q[run.q_row : run.q_row + n * lq].view(n, lq, hq, d).transpose(1, 2)
    kg, vg = (_rows_view(x, run.k_row, n, lk, padded) for x in (k, v))
    if square_causal:  # the kernel's own causal mask, which also skips the masked blocks
        mask, is_causal = None, True
    else:
        mask, is_causal = plan.mask(lq, lk, padded, window, q.device), False
    out = F.scaled_dot_product_attention(
        qg, kg, vg, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=hq != k.shape[1]
    )  # [n, Hq, lq, D], laid out as [n, lq, Hq, D]
    return out.transpose(1, 2).reshape(n * lq, hq, d)


def _rows_view(x: torch.Tensor, row: int, n: int, stride_rows: int, rows: int) -> torch.Tensor:
    """[n, H, rows, D] view of ``x`` [N, H, D]: request i reads rows row + i * stride_rows on,
    ``rows`` of them (more than its own when padded: the extra ones are masked)."""
    s_row, s_head, s_dim = x.stride()
    view = x.as_strided(
        (n, rows, x.shape[1], x.shape[2]),
        (stride_rows * s_row, s_row, s_head, s_dim),
        x.storage_offset() + row * s_row,
    )
    return view.transpose(1, 2)
