"""One pipeline stage: its layers, its KV cache, its per-request mirror.

A step, the same on every stage whatever its role (DESIGN.md §1):

1. register the plan's new requests in the mirror;
2. check the mirror against the plan (expected ``num_computed_tokens``);
3. build the packed batch from the mirror, forward;
4. send hidden states on (non-last stage) or pool (last stage);
5. post-step: advance the mirror, unconditionally;
6. digest the post-step state, check the previous stage's digest, pass ours on.

The role of a stage decides only what it sends, never what state it advances.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from .batch import DeviceUploader, build_host_batch, to_step_inputs
from .config import EngineConfig
from .errors import StateDivergence
from .kv_cache import KVCache
from .layers.attention import flash_supported
from .model_folder import ModelFolder
from .models import StageModel, family_of
from .plan import StepPlan, check_digest
from .pooling import DenseHead, Pooler
from .transport import Inbound, Outbound, StageOutput
from .weights import Checkpoint


@dataclass(frozen=True)
class StageSpec:
    """Where a stage sits in the pipeline and what it runs on."""

    index: int
    num_stages: int
    layers: range
    device: torch.device
    dtype: torch.dtype
    num_kv_blocks: int  # 0 for encoders
    max_model_len: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


@dataclass
class _Mirror:
    """A stage's copy of one request's progress."""

    prompt_len: int
    pooling: str
    block_ids: np.ndarray
    num_computed_tokens: int = 0


class BusyClock:
    """Time a stage spends computing, excluding waits for its inputs. On CUDA it reads event
    pairs once the device has passed them (never blocking the host); on CPU, wall time."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._done_s = 0.0
        self._t0 = 0.0
        self._pending: deque = deque()

    def start(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._pending.append([event, None])
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._pending[-1][1] = event
        else:
            self._done_s += time.perf_counter() - self._t0

    @property
    def seconds(self) -> float:
        while self._pending and self._pending[0][1] is not None and self._pending[0][1].query():
            start, end = self._pending.popleft()
            self._done_s += start.elapsed_time(end) / 1000
        return self._done_s


class StageRunner:
    def __init__(self, config: EngineConfig, folder: ModelFolder, spec: StageSpec) -> None:
        self.config, self.spec = config, spec
        self.model = load_stage_model(config, folder, spec)
        self.kv_cache = None
        if self.model.causal:
            self.kv_cache = KVCache(
                self.model.kv_layout,
                len(spec.layers),
                spec.num_kv_blocks,
                config.block_size,
                dtype=spec.dtype,
                device=spec.device,
            )
        self.pooler = None
        if spec.is_last:
            dense = None
            if folder.st is not None and folder.st.dense:
                dense = DenseHead(folder.st.dense).to(spec.device)
            self.pooler = Pooler(dense)
        self.mirror: dict[int, _Mirror] = {}
        self.token_ids: dict[int, np.ndarray] = {}  # first stage only
        self.uploader = DeviceUploader(spec.device)
        self.clock = BusyClock(spec.device)  # time spent computing, not waiting for inputs

    # -- one step -------------------------------------------------------------------------

    def execute(
        self, plan: StepPlan, inbound: Inbound | None, outbound: Outbound | None
    ) -> StageOutput | None:
        """Run one plan. Non-last stages send through ``outbound`` and return None; the last
        stage returns what goes back to the driver."""
        spec = self.spec
        self._maybe_fail(plan)
        for new in plan.new_requests:
            self.mirror[new.request_id] = _Mirror(new.prompt_len, new.pooling, new.block_ids)
            if spec.is_first:
                self.token_ids[new.request_id] = plan.new_token_ids[new.request_id]
        ids = plan.req_ids.tolist()
        entries = [self._entry(plan.step_id, rid) for rid in ids]
        starts = np.array([m.num_computed_tokens for m in entries], dtype=np.int64)
        if self.config.verify_state:
            self._check_mirror(plan, starts)
        lens = plan.ends - plan.starts

        incoming = inbound.post(plan) if inbound is not None else None
        output = None
        if plan.num_reqs:
            hidden, output = self._forward(plan, entries, starts, lens, incoming)
            if not spec.is_last:
                outbound.send_hidden(hidden)

        self._post_step(plan, ids, entries, lens)
        digest = np.array([m.num_computed_tokens for m in entries], dtype=np.int64)
        self._drop_finished(plan, ids, entries)
        busy = list(incoming.stage_busy_s()) if incoming is not None else []
        busy.append(self.clock.seconds)
        if self.config.verify_state:
            if incoming is not None:
                check_digest(plan, incoming.digest(), stage=spec.index - 1)
            check_digest(plan, digest, stage=spec.index)
        if not spec.is_last:
            outbound.send_digest(plan.step_id, digest, busy)
            return None
        if output is None:
            output = StageOutput([], None, [], [])
        output.step_id, output.digest, output.stage_busy_s = plan.step_id, digest, tuple(busy)
        return output

    def _maybe_fail(self, plan: StepPlan) -> None:
        """Test-only: make this stage raise at a chosen step (fault-handling tests)."""
        c = self.config
        injected = c.inject_fault == "raise_on_stage" and self.spec.index == c.fault_stage
        if injected and plan.step_id >= c.fault_step:
            raise RuntimeError(
                f"injected failure on stage {self.spec.index} at step {plan.step_id}"
            )

    def _entry(self, step_id: int, rid: int) -> _Mirror:
        entry = self.mirror.get(rid)
        if entry is None:
            raise StateDivergence(
                step_id=step_id,
                stage=self.spec.index,
                request_id=rid,
                expected=0,
                found=-1,
                what="mirror entry (request unknown to this stage)",
            )
        return entry

    def _check_mirror(self, plan: StepPlan, starts: np.ndarray) -> None:
        bad = np.nonzero(starts != plan.starts)[0]
        if len(bad):
            i = int(bad[0])
            raise StateDivergence(
                step_id=plan.step_id,
                stage=self.spec.index,
                request_id=int(plan.req_ids[i]),
                expected=int(plan.starts[i]),
                found=int(starts[i]),
            )

    def _forward(self, plan, entries, starts, lens, incoming):
        """Build the batch from the mirror, upload it in one copy, forward; on the last stage
        also pool. Returns (hidden [T, H], StageOutput or None)."""
        model, spec = self.model, self.spec
        prompt_lens = np.array([m.prompt_len for m in entries], dtype=np.int64)
        tables = [m.block_ids for m in entries] if model.causal else None
        batch = build_host_batch(starts, lens, prompt_lens, tables, self.config.block_size)
        ids = plan.req_ids.tolist()
        tokens = rows = seg = None
        if spec.is_first:
            tokens = np.concatenate(
                [
                    self.token_ids[rid][s : s + n]
                    for rid, s, n in zip(ids, starts.tolist(), lens.tolist(), strict=True)
                ]
            )
        poolings = [m.pooling for m in entries]
        if spec.is_last:
            rows, seg = self.pooler.index_arrays(
                starts, starts + lens, batch.cu_q, prompt_lens, poolings
            )
        inputs, (tokens_t, rows_t, seg_t) = to_step_inputs(
            batch, self.uploader, causal=model.causal, extra=[tokens, rows, seg]
        )
        x = tokens_t if spec.is_first else incoming.hidden()
        kv = self.kv_cache.layers() if self.kv_cache is not None else None
        self.clock.start()
        with torch.inference_mode():
            hidden = model(x, inputs, kv)
            if not spec.is_last:
                self.clock.stop()
                return hidden, None
            vec_ids, vectors, all_ids, all_out = self.pooler.pool(
                hidden, rows_t, seg_t, ids, starts, starts + lens, batch.cu_q,
                prompt_lens.tolist(), poolings,
            )  # fmt: skip
        self.clock.stop()
        return hidden, StageOutput(vec_ids, vectors, all_ids, all_out)

    def _post_step(
        self, plan: StepPlan, ids: list[int], entries: list[_Mirror], lens: np.ndarray
    ) -> None:
        """Advance every scheduled request by its chunk, on every stage, whatever the forward
        returned. (The injected fault reproduces the historical bug, for tests only.)"""
        if self.config.inject_fault == "skip_post_step_on_non_last_stage" and not self.spec.is_last:
            return
        for entry, n in zip(entries, lens.tolist(), strict=True):
            entry.num_computed_tokens += n

    def _drop_finished(self, plan: StepPlan, ids: list[int], entries: list[_Mirror]) -> None:
        for rid, entry in zip(ids, entries, strict=True):
            if entry.num_computed_tokens >= entry.prompt_len:
                self._forget(rid)
        for rid in plan.freed_ids:
            self._forget(rid)

    def _forget(self, rid: int) -> None:
        self.mirror.pop(rid, None)
        self.token_ids.pop(rid, None)
        if self.pooler is not None:
            self.pooler.drop(rid)


def load_stage_model(config: EngineConfig, folder: ModelFolder, spec: StageSpec) -> StageModel:
    """Build the stage's modules without allocating them, then fill them from the checkpoint."""
    family = family_of(folder.architecture)
    with torch.device("meta"):
        model = family.build(
            folder.hf_config, spec.layers, spec.is_first, spec.is_last, spec.max_model_len
        )
    model = model.to(dtype=spec.dtype).to_empty(device=spec.device)
    model.reset_buffers()
    checkpoint = Checkpoint(folder.path, family)
    checkpoint.load_stage(model)
    checkpoint.close()
    model.eval()
    if flash_supported(spec.device, spec.dtype):
        model.attn_kernel = "flash"
        if not model.use_fused_qk_rope() and model.causal:
            warnings.warn("fused q/k-norm + RoPE kernel unavailable; using torch ops", stacklevel=2)
    if compile_wanted(config, spec):
        model.set_compiled(True)
        try:
            warm_up(model, spec, config.block_size)
        except Exception as exc:  # an inductor/triton problem must not take the engine down
            warnings.warn(
                f"torch.compile failed on stage {spec.index}, running eagerly: {exc}", stacklevel=2
            )
            model.set_compiled(False)
    return model


def compile_wanted(config: EngineConfig, spec: StageSpec) -> bool:
    return config.compile if config.compile is not None else spec.device.type == "cuda"


def warm_up(model: StageModel, spec: StageSpec, block_size: int, num_tokens: int = 64) -> None:
    """One forward of a dummy single-chunk request (no KV cache traffic), so compilation
    happens at load time rather than inside the first real step."""
    n = np.array([num_tokens])
    tables = [np.zeros(-(-num_tokens // block_size), dtype=np.int64)] if model.causal else None
    batch = build_host_batch(np.array([0]), n, n, tables, block_size)
    inputs, _ = to_step_inputs(batch, DeviceUploader(spec.device), causal=model.causal, extra=[])
    if spec.is_first:
        x = torch.zeros(num_tokens, dtype=torch.int64, device=spec.device)
    else:
        x = torch.randn(num_tokens, model.hidden_size, dtype=spec.dtype, device=spec.device)
    with torch.inference_mode():
        model(x, inputs, None)
