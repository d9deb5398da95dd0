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
    requests whose prompt spans several chunks.

    Two phases, so that nothing syncs the device mid-step: ``index_arrays`` (host, before the
    forward: its arrays ride in the step's single upload) and ``pool`` (device, after it).
    """

    def __init__(self, dense: DenseHead | None) -> None:
        self.dense = dense
        self._partial: dict[int, _Partial] = {}

    def __len__(self) -> int:
        return len(self._partial)

    def drop(self, request_id: int) -> None:
        self._partial.pop(request_id, None)

    @staticmethod
    def index_arrays(
        starts: np.ndarray,
        ends: np.ndarray,
        cu_q: np.ndarray,
        prompt_lens: np.ndarray,
        poolings: list[str],
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """(rows read directly: LAST of final chunks, CLS of first chunks; per-row request
        index for the MEAN segment sum, or None when no request pools MEAN)."""
        rows = []
        for i, kind in enumerate(poolings):
            if kind == "last" and ends[i] == prompt_lens[i]:
                rows.append(cu_q[i + 1] - 1)
            elif kind == "cls" and starts[i] == 0:
                rows.append(cu_q[i])
        seg = np.repeat(np.arange(len(poolings)), np.diff(cu_q)) if "mean" in poolings else None
        return np.asarray(rows, dtype=np.int64), seg

    def pool(
        self,
        hidden: torch.Tensor,  # [T, H] final hidden states of this step, batch order
        rows: torch.Tensor,  # device copy of index_arrays()[0]
        seg: torch.Tensor | None,  # device copy of index_arrays()[1]
        req_ids: list[int],
        starts: np.ndarray,
        ends: np.ndarray,
        cu_q: np.ndarray,
        prompt_lens: list[int],
        poolings: list[str],
    ) -> tuple[list[int], torch.Tensor | None, list[int], list[torch.Tensor]]:
        """Returns (ids, vectors [n, D] fp32) for finished LAST/MEAN/CLS requests and
        (ids, token embeddings [len, H]) for finished ALL requests, all on hidden's device."""
        picked = hidden.index_select(0, rows) if len(rows) else None  # [n_rows, H]
        sums = counts = None
        if seg is not None:
            sums = torch.zeros(
                len(req_ids), hidden.shape[1], dtype=torch.float32, device=hidden.device
            )
            sums.index_add_(0, seg, hidden.float())
            counts = torch.bincount(seg, minlength=len(req_ids)).unsqueeze(1)  # [R, 1]
        vec_ids: list[int] = []
        parts: list[tuple[str, object]] = []  # ("picked", j) | ("sum", i) | ("tensor", t)
        all_ids: list[int] = []
        all_out: list[torch.Tensor] = []
        cursor = 0  # next row of `picked`

        for i, rid in enumerate(req_ids):
            kind, start, end, plen = poolings[i], int(starts[i]), int(ends[i]), prompt_lens[i]
            first, final = start == 0, end == plen
            if kind == "last":
                if final:
                    parts.append(("picked", cursor))
                    cursor += 1
            elif kind == "cls":
                if first:
                    j, cursor = cursor, cursor + 1
                    if final:
                        parts.append(("picked", j))
                    else:
                        self._partial[rid] = _Partial(kind, plen, picked[j].clone())
                elif final:
                    parts.append(("tensor", self._partial.pop(rid).value.float()))
            elif kind == "mean":
                if first and final:
                    parts.append(("sum", i))
                else:
                    total = sums[i] if first else self._partial[rid].value + sums[i]
                    if final:
                        self._partial.pop(rid, None)
                        parts.append(("tensor", total / plen))
                    else:
                        self._partial[rid] = _Partial(kind, plen, total)
            elif kind == "all":
                row0, row1 = int(cu_q[i]), int(cu_q[i + 1])
                if first and final:
                    all_ids.append(rid)
                    all_out.append(hidden[row0:row1])
                    continue
                if first:
                    self._partial[rid] = _Partial(
                        kind, plen, hidden.new_empty((plen, hidden.shape[1]))
                    )
                self._partial[rid].value[start:end] = hidden[row0:row1]
                if final:
                    all_ids.append(rid)
                    all_out.append(self._partial.pop(rid).value)
                continue
            else:
                raise ValueError(f"unknown pooling {kind!r}")
            if final:
                vec_ids.append(rid)

        vectors = _assemble(parts, picked, sums, counts) if parts else None
        if vectors is not None and self.dense is not None:
            vectors = self.dense(vectors)
        return vec_ids, vectors, all_ids, all_out


def _assemble(parts, picked, sums, counts) -> torch.Tensor:
    """Stack finished vectors; the common all-LAST and all-single-chunk-MEAN steps take one
    vectorised op instead of one per request."""
    kinds = {k for k, _ in parts}
    if kinds == {"picked"} and [j for _, j in parts] == list(range(len(picked))):
        return picked.float()
    if kinds == {"sum"} and [i for _, i in parts] == list(range(len(sums))):
        return sums / counts
    rows = []
    for kind, ref in parts:
        if kind == "picked":
            rows.append(picked[ref].float())
        elif kind == "sum":
            rows.append(sums[ref] / counts[ref])
        else:
            rows.append(ref)
    return torch.stack(rows)
