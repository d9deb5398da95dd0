"""Chunk-aware poolers. Pooling state lives on the last stage only.

- LAST reads the final token of the final chunk.
- CLS captures the first token of the first chunk and holds it until the final chunk.
- MEAN keeps a running fp32 sum over chunks and divides by the prompt length at the end.
- ALL copies every chunk into one prompt-sized buffer (token embeddings).

sentence-transformers ``Dense`` modules run on the pooled vector here too, before it leaves
the device; normalisation and Matryoshka truncation are per request and run on the driver
(``heads.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .layers.activation import get_activation
from .model_folder import DenseModule
from .weights import load_linear


class DenseHead(nn.Module):
    """A chain of sentence-transformers Dense modules: activation(linear(x)), in order."""

    def __init__(self, modules: tuple[DenseModule, ...]) -> None:
        super().__init__()
        self.linears = nn.ModuleList()
        self.activations = []
        for m in modules:
            linear = nn.Linear(m.in_features, m.out_features, bias=m.bias)
            tensors = load_linear(m.path)
            with torch.no_grad():
                linear.weight.copy_(tensors["linear.weight"])
                if m.bias:
                    linear.bias.copy_(tensors["linear.bias"])
            self.linears.append(linear)
            self.activations.append(get_activation(m.activation))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for linear, act in zip(self.linears, self.activations, strict=True):
            x = act(linear(x))
        return x


@dataclass
class _Partial:
    """What a multi-chunk request has accumulated so far."""

    pooling: str
    prompt_len: int
    value: torch.Tensor | None = None  # CLS row [H] | MEAN sum [H] fp32 | ALL buffer [len, H]


class Pooler:
    """Turns each step's final hidden states into finished outputs; keeps partial state of
    requests whose prompt spans several chunks."""

    def __init__(self, dense: DenseHead | None) -> None:
        self.dense = dense
        self._partial: dict[int, _Partial] = {}

    def __len__(self) -> int:
        return len(self._partial)

    def drop(self, request_id: int) -> None:
        self._partial.pop(request_id, None)

    def pool(
        self,
        hidden: torch.Tensor,  # [T, H] final hidden states of this step, batch order
        req_ids: list[int],
        starts: np.ndarray,  # [R]
        ends: np.ndarray,  # [R]
        cu_q: np.ndarray,  # [R+1] row offsets of each request in `hidden`
        prompt_lens: list[int],
        poolings: list[str],
    ) -> tuple[list[int], torch.Tensor | None, list[int], list[torch.Tensor]]:
        """Returns (ids, vectors [n, D] fp32) for finished LAST/MEAN/CLS requests and
        (ids, token embeddings [len, H]) for finished ALL requests, all on hidden's device."""
        vec_ids: list[int] = []
        vec_rows: list[int] = []  # LAST/CLS rows of `hidden` finished in this very step
        vec_order: list[tuple[str, int]] = []  # ("row", k) or ("held", k) per finished vector
        held: list[torch.Tensor] = []
        all_ids: list[int] = []
        all_out: list[torch.Tensor] = []
        sums = None
        if "mean" in poolings:
            seg = torch.from_numpy(np.repeat(np.arange(len(req_ids)), np.diff(cu_q))).to(
                hidden.device
            )
            sums = torch.zeros(
                len(req_ids), hidden.shape[1], dtype=torch.float32, device=hidden.device
            )
            sums.index_add_(0, seg, hidden.float())

        for i, rid in enumerate(req_ids):
            kind, start, end, plen = poolings[i], int(starts[i]), int(ends[i]), prompt_lens[i]
            first, final = start == 0, end == plen
            row0, row1 = int(cu_q[i]), int(cu_q[i + 1])
            if kind == "last":
                if final:
                    vec_order.append(("row", len(vec_rows)))
                    vec_rows.append(row1 - 1)
            elif kind == "cls":
                if first and final:
                    vec_order.append(("row", len(vec_rows)))
                    vec_rows.append(row0)
                elif first:
                    self._partial[rid] = _Partial(kind, plen, hidden[row0].clone())
                elif final:
                    vec_order.append(("held", len(held)))
                    held.append(self._partial.pop(rid).value.float())
            elif kind == "mean":
                total = sums[i]
                if not first:
                    total = self._partial[rid].value + total
                if final:
                    self._partial.pop(rid, None)
                    vec_order.append(("held", len(held)))
                    held.append(total / plen)
                else:
                    self._partial[rid] = _Partial(kind, plen, total)
            elif kind == "all":
                if first and final:
                    all_ids.append(rid)
                    all_out.append(hidden[row0:row1])
                    continue
                if first:
                    buf = hidden.new_empty((plen, hidden.shape[1]))
                    self._partial[rid] = _Partial(kind, plen, buf)
                self._partial[rid].value[start:end] = hidden[row0:row1]
                if final:
                    all_ids.append(rid)
                    all_out.append(self._partial.pop(rid).value)
                continue
            else:
                raise ValueError(f"unknown pooling {kind!r}")
            if final:
                vec_ids.append(rid)

        vectors = None
        if vec_ids:
            rows = (
                hidden[torch.tensor(vec_rows, device=hidden.device)].float() if vec_rows else None
            )
            if not held:
                vectors = rows
            else:
                vectors = torch.stack(
                    [rows[k] if src == "row" else held[k] for src, k in vec_order]
                )
            if self.dense is not None:
                vectors = self.dense(vectors)
        return vec_ids, vectors, all_ids, all_out
