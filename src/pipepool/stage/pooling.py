"""Chunk-aware pooling over a whole step at once. Pooling state lives on the last stage only.

- LAST reads the final token of the final chunk.
- CLS captures the first token of the first chunk and holds it until the final chunk.
- MEAN keeps a running fp32 sum over chunks and divides by the prompt length at the end;
  MEAN_SQRT_LEN divides the same sum by the length's square root, WEIGHTEDMEAN sums each token
  weighted by its position + 1 and divides by the weights' sum (sentence-transformers' modes).
- MAX keeps a running elementwise max over chunks.
- SUM keeps the same sum and divides by nothing (SPLADE's sum pooling).
- ALL copies every chunk into one prompt-sized buffer (token embeddings).

A SparseEncoder pools its tokens' vocabulary activations instead of their hidden states
(``token_heads.SpladeTransform``, MAX or SUM); a multi-vector model's token rows (ALL) go
through its token head (ColBERT projections, BGE-M3's heads).

Two phases, so that nothing syncs the device mid-step: ``prepare`` (host, before the
forward: index arrays for the step's single upload) and ``pool`` (device, after it). Requests
whose prompt fits in the step — nearly all of them — are pooled by a few gathers and one
segment sum for the whole step; only prompts spanning several steps keep per-request state.
Then the heads (``heads.py``) run over the step's outputs, still on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core.request import Pooling
from ..layers import invariant_ops
from ..layers.segment_sum import segment_sums
from .heads import DenseHead, HeadParams, ScoreHead, apply_heads
from .invariant_pooling import keep_chunk
from .mirror import StepView
from .token_heads import ColbertTokenHead, M3TokenHead, SpladeTransform


@dataclass(frozen=True)
class PoolingPrep:
    """One step's pooling, decided on the host. Rows are request rows of the plan."""

    pick_rows: np.ndarray  # token rows read directly: emitted picks first, then held CLS
    num_emitted_picks: int  # LAST of final chunks and CLS of whole prompts
    mean_slots: int  # requests pooling MEAN: slot j sums the tokens of mean_req[j]
    num_whole_means: int  # the first slots are MEAN prompts whole in this step
    # The slots' token rows, as one of two: contiguous ranges summed by a device kernel
    # (layers/segment_sum.py), or a per-row slot for index_add_ (mean_slots = none).
    mean_bounds: np.ndarray | None  # [2 * mean_slots]: first rows, then lengths
    seg: np.ndarray | None  # [T] slot of each token row
    whole_mean_lens: np.ndarray  # [num_whole_means] their token counts
    # [num_whole_means] their pooling kinds where some is not MEAN (whose divisor is not the
    # length: ``_divide``); None when all are MEAN.
    whole_mean_kinds: np.ndarray | None
    # [T] int64 weight of each token row in the sums (its position + 1 for WEIGHTEDMEAN rows,
    # 1 elsewhere); None when no request of the step weights its tokens.
    sum_weights: np.ndarray | None
    # MAX: [T] slot of each token row (the last slot: none); None when no request pools MAX.
    max_seg: np.ndarray | None
    num_whole_maxes: int  # the first slots are MAX prompts whole in this step
    all_rows: np.ndarray  # token rows of ALL prompts whole in this step, back to back
    partial: tuple[tuple[int, int], ...]  # (row, slot or -1) of multi-chunk requests
    vector_ids: np.ndarray  # request ids of the output vectors, in output order
    vector_heads: HeadParams
    token_owner_ids: np.ndarray  # request ids of the ALL outputs, in output order
    token_lens: np.ndarray  # their prompt lengths
    token_heads: HeadParams  # per token row of the ALL output
    # Whether the step's outputs read no token row but ``pick_rows`` (no MEAN, MAX or ALL
    # request in it), so that the forward may return those rows alone.
    picks_only: bool

    def upload_arrays(self) -> list[np.ndarray | None]:
        return [
            self.pick_rows, self.seg, self.mean_bounds, self.whole_mean_lens, self.all_rows,
            *self.vector_heads.upload_arrays(), *self.token_heads.upload_arrays(),
            self.whole_mean_kinds, self.sum_weights, self.max_seg,
        ]  # fmt: skip


@dataclass
class PooledStep:
    """What the last stage produced for one plan, still on its device."""

    vector_ids: np.ndarray  # [n] request ids
    vectors: torch.Tensor | None  # [n, D] float32, heads applied
    token_owner_ids: np.ndarray  # [m]
    token_offsets: np.ndarray  # [m+1]
    token_vectors: torch.Tensor | None  # [sum, H] float32, heads applied

    @classmethod
    def empty(cls) -> PooledStep:
        none = np.empty(0, dtype=np.int64)
        return cls(none, None, none, np.zeros(1, dtype=np.int64), None)


class Pooler:
    """Turns each step's final hidden states into finished outputs; keeps the partial state
    of requests whose prompt spans several chunks."""

    def __init__(
        self,
        dense: DenseHead | None,
        score: ScoreHead | None = None,
        splade: SpladeTransform | None = None,
        token_head: M3TokenHead | ColbertTokenHead | None = None,
    ) -> None:
        self.dense = dense
        self.score = score  # a classifier's head: vectors become its (activated) logits
        self.splade = splade  # a SparseEncoder's: vectors pool vocabulary activations
        self.token_head = token_head  # a multi-vector model's: token rows go through it
        self._partial: dict[int, torch.Tensor] = {}  # CLS row [H] | MEAN sum [H] | ALL [len, H]
        # Tokens each accumulator has absorbed (the state digest covers it).
        self._tokens: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._partial)

    def fresh(self) -> Pooler:
        """A pooler with the same heads and no request state."""
        return Pooler(self.dense, self.score, self.splade, self.token_head)

    def drop(self, request_id: int) -> None:
        self._partial.pop(request_id, None)
        self._tokens.pop(request_id, None)

    def state(self) -> tuple[np.ndarray, np.ndarray]:
        """(sorted request ids, tokens absorbed) of the accumulators held now."""
        ids = sorted(self._tokens)
        return np.array(ids, np.int64), np.array([self._tokens[r] for r in ids], np.int64)

    @staticmethod
    def prepare(
        req_ids: np.ndarray, view: StepView, cu_q: np.ndarray, *, by_segments: bool = False
    ) -> PoolingPrep:
        """``by_segments``: MEAN sums by the segment-sum kernel (where it runs: CUDA), else
        by ``index_add_``."""
        kind, starts, ends = view.poolings, view.starts, view.ends
        first, final = starts == 0, ends == view.prompt_lens
        whole = first & final
        is_last, is_cls = kind == Pooling.LAST, kind == Pooling.CLS
        is_mean = np.isin(kind, _SUMS)  # every pooling over a sum of the tokens
        is_all, is_max = kind == Pooling.ALL, kind == Pooling.MAX

        emitted = np.nonzero((is_last & final) | (is_cls & whole))[0]
        held = np.nonzero(is_cls & first & ~final)[0]  # CLS rows kept for a later chunk
        pick_req = np.concatenate([emitted, held])
        pick_rows = np.where(kind[pick_req] == Pooling.LAST, cu_q[pick_req + 1] - 1, cu_q[pick_req])

        mean_whole = np.nonzero(is_mean & whole)[0]
        mean_part = np.nonzero(is_mean & ~whole)[0]
        mean_req = np.concatenate([mean_whole, mean_part])
        seg = bounds = None
        if len(mean_req) and by_segments:
            bounds = np.concatenate([cu_q[mean_req], view.lens[mean_req]])
        elif len(mean_req):
            slot_of = np.full(len(kind), len(mean_req), dtype=np.int64)
            slot_of[mean_req] = np.arange(len(mean_req))
            seg = np.repeat(slot_of, view.lens)

        sum_weights = None
        weighted = np.nonzero(kind == Pooling.WEIGHTEDMEAN)[0]
        if len(weighted):  # each token's position + 1, from the chunk's start
            sum_weights = np.ones(int(cu_q[-1]), dtype=np.int64)
            rows = _row_ranges(cu_q[weighted], view.lens[weighted])
            positions = _row_ranges(starts[weighted], view.lens[weighted])
            sum_weights[rows] = positions + 1

        max_whole = np.nonzero(is_max & whole)[0]
        max_part = np.nonzero(is_max & ~whole)[0]
        max_req = np.concatenate([max_whole, max_part])
        max_seg = None
        if len(max_req):
            slot_of = np.full(len(kind), len(max_req), dtype=np.int64)
            slot_of[max_req] = np.arange(len(max_req))
            max_seg = np.repeat(slot_of, view.lens)

        all_whole = np.nonzero(is_all & whole)[0]
        all_rows = _row_ranges(cu_q[all_whole], view.lens[all_whole])

        multi = np.nonzero(~whole & (is_cls | is_mean | is_all | is_max))[0]
        slot_of_mean = {int(r): len(mean_whole) + j for j, r in enumerate(mean_part.tolist())}
        slot_of_mean |= {int(r): len(max_whole) + j for j, r in enumerate(max_part.tolist())}
        partial = tuple((int(r), slot_of_mean.get(int(r), -1)) for r in multi.tolist())
        picks_only = not (len(mean_req) or len(max_req) or len(all_whole)) and bool(
            (kind[multi] == Pooling.CLS).all()
        )
        partial_vec = multi[final[multi] & ~is_all[multi]]  # emitted from partial state
        partial_all = multi[final[multi] & is_all[multi]]

        vec_rows = np.concatenate([emitted, mean_whole, max_whole, partial_vec])
        tok_rows = np.concatenate([all_whole, partial_all])
        tok_lens = view.prompt_lens[tok_rows]
        return PoolingPrep(
            pick_rows=pick_rows,
            num_emitted_picks=len(emitted),
            mean_slots=len(mean_req),
            num_whole_means=len(mean_whole),
            mean_bounds=bounds,
            seg=seg,
            whole_mean_lens=view.lens[mean_whole],
            whole_mean_kinds=(
                kind[mean_whole].astype(np.int64)
                if (kind[mean_whole] != Pooling.MEAN).any()
                else None
            ),
            sum_weights=sum_weights,
            max_seg=max_seg,
            num_whole_maxes=len(max_whole),
            all_rows=all_rows,
            partial=partial,
            vector_ids=req_ids[vec_rows],
            vector_heads=HeadParams(view.dimensions[vec_rows], view.normalize[vec_rows]),
            token_owner_ids=req_ids[tok_rows],
            token_lens=tok_lens,
            token_heads=HeadParams(
                np.repeat(view.dimensions[tok_rows], tok_lens),
                np.repeat(view.normalize[tok_rows], tok_lens),
            ),
            picks_only=picks_only,
        )

    def pool(
        self,
        hidden: torch.Tensor,  # [T, H] final hidden states of this step, batch order
        prep: PoolingPrep,
        uploaded: list[torch.Tensor | None],  # device copies of prep.upload_arrays()
        req_ids: np.ndarray,
        view: StepView,
        cu_q: np.ndarray,
        *,
        picks: bool = False,
    ) -> PooledStep:
        """``picks``: ``hidden`` holds the rows ``prep.pick_rows`` alone, in that order (the
        forward kept them, ``StepInputs.keep_rows``; only where ``prep.picks_only``)."""
        assert not picks or prep.picks_only, "a step that reads other rows than its picks"
        (pick_t, seg_t, bounds_t, mean_lens_t, all_rows_t, vdims_t, vnorm_t, tdims_t, tnorm_t,
         mean_kinds_t, weights_t, max_seg_t) = uploaded  # fmt: skip
        # Uploads of arrays that are never None (possibly empty).
        assert pick_t is not None and mean_lens_t is not None and all_rows_t is not None
        h = hidden.shape[1]
        picked = None
        if len(prep.pick_rows):
            rows = hidden[: len(prep.pick_rows)] if picks else hidden.index_select(0, pick_t)
            picked = rows.float()
        sums = maxes = summed = None
        if self.splade is not None:  # vocabulary activations, pooled a block at a time
            splade = self.splade
            if picked is not None:
                picked = splade(picked)
            if seg_t is not None:
                sums = splade.pool_rows(hidden, seg_t, prep.mean_slots + 1, "sum", weights_t)
            if max_seg_t is not None:
                assert prep.max_seg is not None  # max_seg_t is its upload
                maxes = splade.pool_rows(hidden, max_seg_t, int(prep.max_seg.max()) + 1, "amax")
        elif bounds_t is not None or seg_t is not None:
            summed = hidden if weights_t is None else hidden.float() * weights_t.unsqueeze(1)
            if bounds_t is not None:
                sums = segment_sums(summed, bounds_t)  # [slots, H]
            else:
                assert seg_t is not None
                sums = hidden.new_zeros((prep.mean_slots + 1, h), dtype=torch.float32)
                sums.index_add_(0, seg_t, summed.float())  # [slots + 1, H]; the last: no slot
        if max_seg_t is not None and self.splade is None:
            assert prep.max_seg is not None  # max_seg_t is its upload
            slots = int(prep.max_seg.max()) + 1
            maxes = hidden.new_full((slots, h), float("-inf"), dtype=torch.float32)
            index = max_seg_t.unsqueeze(1).expand(-1, h)
            maxes.scatter_reduce_(0, index, hidden.float(), "amax")  # the last slot: none
        vectors = []
        if prep.num_emitted_picks:
            assert picked is not None  # the emitted picks are rows of pick_rows
            vectors.append(picked[: prep.num_emitted_picks])
        if prep.num_whole_means:
            # Divisors from the host: torch.bincount would wait for the device (its output
            # size depends on the data), and the host must never wait mid-step.
            n = prep.num_whole_means
            assert sums is not None  # MEAN slots come with their bounds or segments
            vectors.append(_divide(sums[:n], mean_lens_t, mean_kinds_t))
        if prep.num_whole_maxes:
            assert maxes is not None  # MAX slots come with max_seg
            vectors.append(maxes[: prep.num_whole_maxes])
        tokens = [hidden.index_select(0, all_rows_t).float()] if len(prep.all_rows) else []
        held = iter(range(prep.num_emitted_picks, len(prep.pick_rows)))
        for row, slot in prep.partial:
            if view.poolings[row] in _SUMS and invariant_ops.active():
                assert summed is not None  # sum poolings come with their rows
                out = self._advance_whole_sum(summed, req_ids, view, cu_q, row)
                if out is not None:
                    vectors.append(out)
                continue
            sums_of = maxes if view.poolings[row] == Pooling.MAX else sums
            out = self._advance_partial(
                hidden, picked, held, sums_of, req_ids, view, cu_q, row, slot
            )
            if out is not None:
                (tokens if view.poolings[row] == Pooling.ALL else vectors).append(out)

        vec = _cat(vectors)
        if vec is not None and self.dense is not None:
            vec = self.dense(vec)
        if vec is not None and self.score is not None:
            vec = self.score(vec, prep.vector_heads, vnorm_t)
        elif vec is not None:
            vec = apply_heads(vec, prep.vector_heads, vdims_t, vnorm_t)
        tok = _cat(tokens)
        offsets = np.zeros(len(prep.token_lens) + 1, dtype=np.int64)
        np.cumsum(prep.token_lens, out=offsets[1:])
        if tok is not None and self.score is not None:  # a token classifier: logits per token
            tok = self.score(tok, prep.token_heads, tnorm_t)
        elif tok is not None and isinstance(self.token_head, M3TokenHead):
            first = torch.as_tensor(offsets[:-1]).to(tok.device, non_blocking=True)
            heads = prep.token_heads
            norm: torch.Tensor | bool
            if heads.uniform:
                norm = bool(heads.normalize[0]) if len(heads.normalize) else True
            else:
                assert tnorm_t is not None, "non-uniform rows come with their arrays"
                norm = tnorm_t.index_select(0, first).bool()
            tok = self.token_head(tok, first, norm)
        elif tok is not None:
            if self.token_head is not None:  # ColBERT: projections, then the usual heads
                tok = self.token_head(tok)
            tok = apply_heads(tok, prep.token_heads, tdims_t, tnorm_t)
        return PooledStep(prep.vector_ids, vec, prep.token_owner_ids, offsets, tok)

    def _advance_whole_sum(self, summed, req_ids, view, cu_q, row) -> torch.Tensor | None:
        """batch_invariant: one multi-chunk sum pooling, its rows kept and summed whole at
        its last chunk (stage/invariant_pooling.py); its output then, else None."""
        rid, kind = int(req_ids[row]), int(view.poolings[row])
        end, prompt_len = int(view.ends[row]), int(view.prompt_lens[row])
        if end == prompt_len:
            self._tokens.pop(rid, None)
        else:
            self._tokens[rid] = end
        rows = summed[int(cu_q[row]) : int(cu_q[row + 1])]
        total = keep_chunk(self._partial, rid, rows, int(view.starts[row]), prompt_len)
        if total is None:
            return None
        kinds = torch.tensor([kind], device=total.device)
        return _divide(total, torch.tensor([prompt_len], device=total.device), kinds)

    def _advance_partial(self, hidden, picked, held, sums, req_ids, view, cu_q, row, slot):
        """One multi-chunk request: update its state; its output if this is its final chunk."""
        rid = int(req_ids[row])
        kind = int(view.poolings[row])
        start, end = int(view.starts[row]), int(view.ends[row])
        prompt_len = int(view.prompt_lens[row])
        first, final = start == 0, end == prompt_len
        if final:
            self._tokens.pop(rid, None)
        else:
            self._tokens[rid] = end
        if kind == Pooling.CLS:
            if first:
                self._partial[rid] = picked[next(held)].clone()
                return None
            return self._partial.pop(rid).unsqueeze(0) if final else None
        if kind == Pooling.MAX:  # ``sums`` holds the step's maxima here
            top = sums[slot] if first else torch.maximum(self._partial[rid], sums[slot])
            if final:
                self._partial.pop(rid, None)
                return top.unsqueeze(0)
            self._partial[rid] = top
            return None
        if kind in _SUMS:
            total = sums[slot] if first else self._partial[rid] + sums[slot]
            if final:
                self._partial.pop(rid, None)
                kinds = torch.tensor([kind], device=total.device)
                lens = torch.tensor([prompt_len], device=total.device)
                return _divide(total.unsqueeze(0), lens, kinds)
            self._partial[rid] = total
            return None
        # ALL: each chunk goes to its place in a prompt-sized buffer
        if first:
            self._partial[rid] = hidden.new_empty((prompt_len, hidden.shape[1]))
        self._partial[rid][start:end] = hidden[int(cu_q[row]) : int(cu_q[row + 1])]
        return self._partial.pop(rid).float() if final else None


# Poolings over a (weighted) sum of a prompt's tokens; they differ in weights and divisor.
_SUMS = (Pooling.MEAN, Pooling.MEAN_SQRT_LEN, Pooling.WEIGHTEDMEAN, Pooling.SUM)


def _divide(sums: torch.Tensor, lengths: torch.Tensor, kinds: torch.Tensor | None) -> torch.Tensor:
    """[n, H] sums over their divisors: the length (MEAN), its square root (MEAN_SQRT_LEN),
    the sum of the weights 1..length (WEIGHTEDMEAN), or 1 (SUM). ``kinds`` None: every row is
    MEAN."""
    n = lengths.to(torch.float64)
    if kinds is not None:
        n = torch.where(kinds == Pooling.MEAN_SQRT_LEN, n.sqrt(), n)
        n = torch.where(kinds == Pooling.WEIGHTEDMEAN, n * (n + 1) / 2, n)
        n = torch.where(kinds == Pooling.SUM, torch.ones_like(n), n)
    return sums / n.to(sums.dtype).unsqueeze(1)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The parts as one tensor; a single part as it is (the usual step: no copy)."""
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _row_ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(s, s + n)`` for each (s, n), without a Python loop."""
    total = int(lens.sum())
    if not total:
        return np.empty(0, dtype=np.int64)
    offsets = np.zeros(len(lens), dtype=np.int64)
    np.cumsum(lens[:-1], out=offsets[1:])
    return np.arange(total, dtype=np.int64) - np.repeat(offsets - starts, lens)
