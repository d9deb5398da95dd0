"""A stage's forward replayed as CUDA graphs: one launch per piece instead of one per kernel.

Piecewise, as vLLM does it: a graph cannot hold what attention needs per step (sequence
boundaries, their maximum lengths, KV-cache slots), so each forward is captured as pieces
cut at every attention call. Replaying a step runs piece 0 (embeddings, projections, norms,
rotary...), then layer 0's attention eagerly on this step's metadata, then piece 1, and so
on. Attention reads q/k/v where piece i left them and writes where piece i+1 reads.

An encoder whose attention is the Triton kernel is captured whole instead, one graph a step:
that kernel runs from a work list with a fixed grid, reading the step's request offsets and
work list from buffers the graph owns (``layers/triton_attention.py``), which each replay
refills; so the host launches one graph where the pieces cost a replay and an attention
launch per layer.

Steps with key lengths (``AttentionMetadata.key_rows``: each request's keys a prefix of its
rows) replay as pieces like any other, their attention being eager; a whole-step graph reads
one set of offsets for queries and keys, so there they run eagerly.

Captured per padded token count (``graph_buckets``; whole graphs also per attention grid,
``_programs``; a model that ``keeps_rows`` also per padded count of kept rows,
``keep_bucket``), lazily, the first time a step of that size runs; steps larger than the
largest bucket run eagerly. Padded rows hold stale values (in a whole graph's attention
output, whatever the memory held) and are never read: attention reads only the step's real
rows, and every other operation is row-wise.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..layers import triton_attention
from ..layers.attention import AttentionMetadata, attend
from ..models import StageModel, StepInputs


def graph_buckets(max_tokens: int) -> list[int]:
    """Padded step sizes: powers of two up to 256, then four per octave (a step pays at most
    25% padding, 12% on average), up to the first size >= ``max_tokens``."""
    sizes, size = [], 16
    while True:
        sizes.append(size)
        if size >= max_tokens:
            return sizes
        size += size if size < 256 else 1 << (size.bit_length() - 3)


def keep_bucket(rows: int, bucket: int) -> int | None:
    """The padded count of kept rows (``StepInputs.keep_rows``) a graph of ``bucket`` rows is
    captured with: a power of four from 16, so that a bucket has few such graphs; None where
    that is over a quarter of the bucket (the graph keeps every row, the rows are picked
    after it)."""
    size = 16
    while size < rows:
        size *= 4
    return size if 4 * size <= bucket else None


@dataclass(eq=False)
class _Attention:
    """One attention call between two pieces, with the tensors the pieces share with it."""

    q: torch.Tensor  # [B, Hq, D] written by the piece before
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: tuple[torch.Tensor, torch.Tensor] | None
    scale: float
    window: int | None
    kernel: str
    softcap: float | None
    out: torch.Tensor  # [B, Hq, D] read by the piece after

    def run(self, meta: AttentionMetadata, n: int) -> None:
        attend(
            self.q[:n], self.k[:n], self.v[:n], meta, self.kv_cache, scale=self.scale,
            window=self.window, kernel=self.kernel, softcap=self.softcap, out=self.out[:n],
        )  # fmt: skip


class _Captured:
    """The pieces of one bucket's forward and the attention calls between them."""

    def __init__(self) -> None:
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.attention: list[_Attention] = []
        self.output: torch.Tensor | None = None  # [B, H], written by the last piece

    def replay(self, meta: AttentionMetadata, n: int, out_rows: int) -> torch.Tensor:
        """Replay on a step of ``n`` rows; the first ``out_rows`` rows of the output."""
        for i, piece in enumerate(self.pieces):
            piece.replay()
            if i < len(self.attention):
                self.attention[i].run(meta, n)
        assert self.output is not None, "replayed before it was captured"
        return self.output[:out_rows]


class GraphedForward:
    """Drop-in for ``model(x, inputs, kv)`` on CUDA. The returned hidden states are a view of
    the graph's output buffer, valid until the next call (``copy_output`` returns a copy, for
    a stage that sends them to another process); with ``inputs.keep_rows``, those rows alone,
    in that order, as the model returns them."""

    def __init__(
        self, model: StageModel, *, max_tokens: int, device: torch.device, copy_output: bool
    ) -> None:
        self.model = model
        self.buckets = graph_buckets(max_tokens)
        self.copy_output = copy_output
        self.device = device
        largest = self.buckets[-1]
        if model.is_first:
            self.static_x = torch.zeros(largest, dtype=torch.int64, device=device)
        else:
            dtype = next(model.parameters()).dtype
            self.static_x = torch.zeros(largest, model.hidden_size, dtype=dtype, device=device)
        self.static_positions = torch.zeros(largest, dtype=torch.int64, device=device)
        # An encoder's first stage reads token types (pairs of cross-encoders), so its graphs
        # are captured reading them from a buffer: zeros for steps of single texts.
        self.static_types = None
        if model.is_first and not model.causal:
            self.static_types = torch.zeros(largest, dtype=torch.int64, device=device)
        # Whole-step graphs (see the module's note): the attention metadata's buffers.
        self.block_rows = model.attention_block_rows()
        self.whole = self.block_rows is not None
        if self.whole:
            # A step of n rows has at most n items (a block per request of up to BLOCK_M rows).
            self.static_cu = torch.zeros(largest + 1, dtype=torch.int32, device=device)
            self.static_work = torch.zeros(1 + 2 * largest, dtype=torch.int64, device=device)
        # The rows a graph keeps (``StepInputs.keep_rows``), read by its last piece.
        self.static_keep = torch.zeros(largest, dtype=torch.int64, device=device)
        # By bucket; whole-step graphs by (bucket, attention programs); graphs that keep
        # rows by (bucket, -kept rows).
        self.captured: dict[int | tuple[int, int], _Captured] = {}
        self._pool = torch.cuda.graph_pool_handle()  # shared: buckets never replay at once
        self._stream = torch.cuda.Stream(device)

    def __call__(self, x: torch.Tensor, inputs: StepInputs, kv_caches) -> torch.Tensor:
        n = x.shape[0]
        bucket = next((b for b in self.buckets if b >= n), None)
        if bucket is None:
            return self.model(x, inputs, kv_caches)
        self.static_x[:n].copy_(x)
        self.static_positions[:n].copy_(inputs.positions)
        if self.static_types is not None:
            if inputs.token_type_ids is not None:
                self.static_types[:n].copy_(inputs.token_type_ids)
            else:
                self.static_types[:n].zero_()
        meta, keep = inputs.attn, inputs.keep_rows
        key: int | tuple[int, int] = bucket
        programs = 0
        if self.whole:
            # A step without the kernel's work list, or whose keys are not its rows.
            if meta.work is None or meta.key_rows is not None:
                return self.model(x, inputs, kv_caches)
            programs = self._programs(bucket, meta.work_programs)
            key = (bucket, programs)
        kept = None
        if keep is not None and not self.whole:
            kept = keep_bucket(keep.shape[0], bucket)
            if kept is not None:
                # Padded with row 0: a stale index of a larger bucket would read past this one.
                self.static_keep[: keep.shape[0]].copy_(keep)
                self.static_keep[keep.shape[0] : kept].zero_()
                key = (bucket, -kept)
        graphs = self.captured.get(key)
        if graphs is None:
            try:
                if self.whole:
                    graphs = self._capture(
                        bucket, self._whole_meta(bucket, programs), None, split=False
                    )
                else:  # captured on one sequence of ``bucket`` tokens, not this step's
                    dummy = _whole_sequence(bucket, self.model.causal, self.device)
                    graphs = self._capture(bucket, dummy, kv_caches, split=True, kept=kept)
                self.captured[key] = graphs
            except Exception as exc:  # a kernel that cannot be captured must not stop us
                warnings.warn(f"CUDA graph capture failed, running eagerly: {exc}", stacklevel=2)
                self.buckets = []
                return self.model(x, inputs, kv_caches)
        if self.whole:  # after any capture, which fills these buffers with its own
            assert meta.work is not None  # whole graphs run only steps with a work list (above)
            self.static_cu[: len(meta.cu_q_host)].copy_(meta.cu_seqlens_q)
            self.static_work[: meta.work.shape[0]].copy_(meta.work)
        if kept is not None:
            assert keep is not None  # kept is its padded count
            out = graphs.replay(meta, n, keep.shape[0])
        else:
            out = graphs.replay(meta, n, n)
            if keep is not None:  # the graph kept every row
                out = out.index_select(0, keep)
        return out.clone() if self.copy_output else out

    # -- capture ------------------------------------------------------------------------------

    def _capture(
        self,
        bucket: int,
        meta: AttentionMetadata,
        kv_caches,
        *,
        split: bool,
        kept: int | None = None,
    ) -> _Captured:
        """Warm up eagerly (lazy initialisation, compilation), then capture the forward of
        ``bucket`` rows on ``meta``: as pieces cut at every attention call (``split``), or
        whole; keeping the rows ``static_keep[:kept]`` (``StepInputs.keep_rows``) where given."""
        types = self.static_types[:bucket] if self.static_types is not None else None
        keep = self.static_keep[:kept] if kept is not None else None
        step = StepInputs(self.static_positions[:bucket], meta, types, keep)
        x = self.static_x[:bucket]
        captured = _Captured()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.model(x, step, kv_caches)  # warm-up
            # The warm-up's blocks back to the device: the graphs' private pool cannot take
            # them from the allocator's cache, and a large bucket needs them.
            torch.cuda.empty_cache()
            if split:
                splitter = _Splitter(captured, meta, self._pool)
                step = replace(step, attn=replace(meta, graph_split=splitter))
                splitter.begin()
                try:
                    captured.output = self.model(x, step, kv_caches)
                finally:
                    splitter.end()
            else:
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    captured.output = self.model(x, step, kv_caches)
                finally:
                    graph.capture_end()
                captured.pieces.append(graph)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return captured

    def _programs(self, bucket: int, items: int) -> int:
        """The attention grid a whole-step graph is captured with: four times the bucket's
        query blocks, enough for steps of requests down to a quarter block long on average
        (the programs without an item exit at once); else one per row, enough for any step."""
        assert self.block_rows is not None, "only whole-step graphs have an attention grid"
        usual = min(4 * -(-bucket // self.block_rows), bucket)
        return usual if items <= usual else bucket

    def _whole_meta(self, bucket: int, programs: int) -> AttentionMetadata:
        """A whole-step graph's attention metadata: ``static_cu`` and ``static_work``, with
        ``programs`` programs a head. Filled here with one sequence of ``bucket`` tokens for
        the capture; each replay's own metadata is copied in after."""
        assert self.block_rows is not None, "only whole-step graphs have a work list"
        whole = np.array([0, bucket], dtype=np.int64)
        work = triton_attention.work_list(whole, self.block_rows)
        self.static_cu[:2].copy_(torch.from_numpy(whole))
        self.static_work[: len(work)].copy_(torch.from_numpy(work))
        return AttentionMetadata(
            causal=False, cu_seqlens_q=self.static_cu, cu_seqlens_k=self.static_cu,
            max_q=bucket, max_k=bucket, cu_q_host=whole, cu_k_host=whole, total_k=bucket,
            work=self.static_work, work_programs=programs,
        )  # fmt: skip


class _Splitter:
    """Called by ``attend`` during capture: ends the current piece, runs attention eagerly
    once (on the capture's dummy metadata, so the output buffer holds finite values), and
    starts the next piece."""

    def __init__(self, captured: _Captured, meta: AttentionMetadata, pool) -> None:
        self.captured, self.meta, self.pool = captured, meta, pool
        self._graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        # thread_local: other threads (NCCL, the host copy of results) may use CUDA meanwhile
        self._graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def end(self) -> None:
        assert self._graph is not None, "end() without begin()"
        self._graph.capture_end()
        self.captured.pieces.append(self._graph)

    def __call__(self, q, k, v, kv_cache, *, scale, window, kernel, softcap) -> torch.Tensor:
        self.end()
        call = _Attention(q, k, v, kv_cache, scale, window, kernel, softcap, torch.empty_like(q))
        call.run(self.meta, q.shape[0])
        self.captured.attention.append(call)
        self.begin()
        return call.out


def _whole_sequence(n: int, causal: bool, device: torch.device) -> AttentionMetadata:
    """Attention metadata of one sequence of ``n`` tokens with no KV-cache traffic."""
    cu_host = np.array([0, n], dtype=np.int64)
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    return AttentionMetadata(
        causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, max_q=n, max_k=n,
        cu_q_host=cu_host, cu_k_host=cu_host, total_k=n,
    )  # fmt: skip
