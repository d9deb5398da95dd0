"""One pipeline stage: its layers, its KV cache, its per-request mirror.

A step, the same on every stage whatever its role (docs/design.md §1):

1. register the plan's new requests in the mirror;
2. check the mirror against the plan (expected ``num_computed_tokens``): the mirror check;
3. build the packed batch (positions from the plan's chunk starts, KV slots from the block
   table the plan sent with a request's first chunk), forward;
4. send hidden states on (non-last stage) or pool (last stage);
5. post-step: advance the mirror by its own count, unconditionally;
6. check the digest the previous stage sent (the neighbour check), fold the hash of this
   stage's whole per-request state into it, pass it on (the driver checks the chain).

The role of a stage decides only what it sends, never what state it advances.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import deque
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..config import EngineConfig
from ..core.digest import Digest, check_digest, empty_ids
from ..core.plan import StepPlan
from ..errors import StateDivergence
from ..layers import invariant_tiles, segment_sum
from ..layers.invariant_ops import batch_invariant
from ..loading.model_folder import ModelFolder
from ..loading.stage_spec import StageSpec
from ..loading.weights import Checkpoint
from ..models import StageModel, family_of
from ..tracing.stage import StageTrace, traced
from .background_compile import BackgroundCompile, compiled_layer_body
from .batch import DeviceUploader, build_host_batch, step_key_lens, to_step_inputs
from .cuda_graphs import GraphedForward
from .heads import DenseHead, ScoreHead
from .image_features import ImageFeatures
from .kv_cache import KVCache
from .mirror import Mirror, StepView
from .output import StageOutput
from .pooling import PooledStep, Pooler
from .token_heads import build_token_heads
from .transport import Inbound, Outbound

if TYPE_CHECKING:
    from ..loading.deployment import Deployment

_log = logging.getLogger("pipepool.stage")


class BusyClock:
    """Time a stage spends computing, excluding waits for its inputs. On CUDA it reads event
    pairs once the device has passed them (never blocking the host); on CPU, wall time."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._done_s = 0.0
        self._t0 = 0.0
        # CPU: starts not yet stopped. A step computed between two layers of another
        # (``models.between_layers``) starts and stops inside it: its time is the outer's.
        self._open = 0
        self._pending: deque = deque()

    def start(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._pending.append([event, None])
        else:
            if not self._open:
                self._t0 = time.perf_counter()
            self._open += 1

    def stop(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._pending[-1][1] = event
        else:
            self._open -= 1
            if not self._open:
                self._done_s += time.perf_counter() - self._t0

    @property
    def seconds(self) -> float:
        while self._pending and self._pending[0][1] is not None and self._pending[0][1].query():
            start, end = self._pending.popleft()
            self._done_s += start.elapsed_time(end) / 1000
        return self._done_s


class StageRunner:
    """One pipeline stage: its slice of the model, its KV cache, its mirror of every request's
    progress and (last stage) the pooler and heads.

    ``execute(plan, inbound, outbound)`` applies one plan: the mirror check against the plan,
    the forward over the packed batch, the post-step (every stage advances every scheduled
    request by its chunk, whatever its role), the drop of finished requests, and the digest of
    its state for the next stage or the driver. Plans are applied strictly in order, by one
    thread, except that an encoder's plan of light calls may be applied between two layers of
    the plan before it (``models.between_layers``: its requests live that step only). The
    steps of ``execute`` are methods (``_view``, ``_post_step``, ``_drop``, ``_pools``), each
    one job that can be read, timed and checked alone.
    """

    def __init__(self, config: EngineConfig, folder: ModelFolder, spec: StageSpec) -> None:
        # The load-time kernel self-check and the warm-up launch kernels on the current device.
        with current_device(spec.device):
            self._load(config, folder, spec)

    def _load(self, config: EngineConfig, folder: ModelFolder, spec: StageSpec) -> None:
        self.config, self.spec = config, spec
        self.model = load_stage_model(
            config, folder, spec, compile_now=spec.compile and not spec.compile_in_background
        )
        if config.batch_invariant:  # its products' checks made before the KV cache is taken
            invariant_tiles.check_linears(self.model)
        self.kv_cache = None
        if self.model.causal:
            layout = self.model.kv_layout
            assert layout is not None, "a causal model keeps a KV cache"
            self.kv_cache = KVCache(
                layout,
                len(spec.layers),
                spec.num_kv_blocks,
                config.block_size,
                dtype=spec.dtype,
                device=spec.device,
            )
        self.pooler = None
        if self._pools():
            dense = None
            if folder.st is not None and folder.st.dense:
                dense = DenseHead(folder.st.dense).to(spec.device)
            score = None
            if spec.classifier is not None and spec.is_last:
                head = self.model.score_head
                assert head is not None, "a classifier's last stage has its score head"
                score = ScoreHead(head, spec.classifier.activation)
            splade, token_head = build_token_heads(
                spec.retrieval, folder, self.model.hidden_size, spec.dtype, spec.device
            )
            self.pooler = Pooler(dense, score, splade, token_head)
        self.compiling: BackgroundCompile | None = None
        self.forward = self.model
        if spec.compile and spec.compile_in_background:
            # Eager, and no CUDA graphs until the compiled bodies are in: a capture here would
            # fail on the compiling thread's device allocations (``_install_compiled``).
            self.compiling = BackgroundCompile(
                self.model, lambda shadow: warm_up(shadow, spec, config.block_size), spec
            )
        else:
            self.forward = self._graphed()
        self.mirror = Mirror(spec.index)
        # A vision-language model's first stage: its requests' image features in flight.
        token = self.model.image_token_id
        self.image_features = ImageFeatures(spec.index, token) if token is not None else None
        # Fixed at load, read every step: the attention kernel's work list (encoders with the
        # Triton kernel), MEAN sums by the segment-sum kernel (CUDA).
        self.attn_block_rows = self.model.attention_block_rows()
        # Whether every attention of the model can key a prefix of a prompt (key lengths).
        self.takes_key_lengths = family_of(folder.architecture).honours_key_lengths(
            folder.hf_config, spec.causal
        )
        self.mean_by_segments = segment_sum.supported(spec.device) and not (
            self.pooler is not None and self.pooler.splade is not None
        )
        self.uploader = DeviceUploader(spec.device)
        self.clock = BusyClock(spec.device)  # time spent computing, not waiting for inputs
        # The step timeline (EngineConfig.trace); None when off, and then nothing is recorded.
        self.trace = StageTrace(spec.index, spec.device) if config.trace else None

    def _graphed(self):
        """The forward to step with: CUDA graphs where the deployment wants them."""
        spec = self.spec
        if spec.device.type != "cuda" or not spec.graph_max_tokens:
            return self.model
        # A stage that sends its hidden states on must not hand out the graph's buffer: the
        # next replay would overwrite it while the send is in flight.
        return GraphedForward(
            self.model, max_tokens=spec.graph_max_tokens, device=spec.device,
            copy_output=not spec.is_last,
        )  # fmt: skip

    def _install_compiled(self) -> None:
        """Between two steps: the compiled layer bodies, once the compiling thread is done."""
        assert self.compiling is not None, "only called while compiling in the background"
        ended, body = self.compiling.take()
        if not ended:
            return
        if body is not None:
            self.model.use_layer_body(body)
            _log.info("stage %d: compiled layer bodies in use", self.spec.index)
        self.forward = self._graphed()
        self.compiling = None

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until background compilation (if any) has ended; the next step installs it.
        Any thread: the loop thread may clear ``compiling`` meanwhile, so it is read once."""
        compiling = self.compiling
        return compiling is None or compiling.wait(timeout)

    def forget_requests(self) -> None:
        """Drop every request's state: the pipeline was restarted and its requests start over
        (the KV cache needs no clearing: a slot is always written before it is read)."""
        self.mirror = Mirror(self.spec.index)
        if self.image_features is not None:
            self.image_features.keep(())
        if self.pooler is not None:
            self.pooler = self.pooler.fresh()
        self.clock = BusyClock(self.spec.device)  # counts from zero, as the new stages do

    # -- one step -------------------------------------------------------------------------

    def execute(
        self, plan: StepPlan, inbound: Inbound | None, outbound: Outbound | None
    ) -> StageOutput | None:
        """Run one plan. Non-last stages send through ``outbound`` and return None; the last
        stage returns what goes back to the driver."""
        spec, verify, tr = self.spec, self.config.verify_state, self.trace
        if self.compiling is not None:
            self._install_compiled()
        if tr is not None:
            tr.begin_step(plan)
            inbound, outbound = traced(tr, inbound, outbound)
        view = self._view(plan)
        if verify:
            self._check_mirror(plan, view.mirror_starts)

        incoming = inbound.post(plan) if inbound is not None else None
        pooled = PooledStep.empty()
        if plan.num_reqs:
            hidden, pooled = self._forward(plan, view, incoming)
            if not spec.is_last:
                assert outbound is not None, "a stage before the last sends on"
                if tr is not None:
                    tr.phase("send")
                outbound.send_hidden(hidden)
        if tr is not None:
            tr.phase("post-step")

        post = self._post_step(view)
        self._drop(plan, view)
        busy = list(incoming.stage_busy_s()) if incoming is not None else []
        busy.append(self.clock.seconds)
        digest = self._digest(plan, view, post, incoming) if verify else None
        output = None
        if spec.is_last:
            output = StageOutput(plan.step_id, digest, tuple(busy), pooled)
        else:
            assert outbound is not None, "a stage before the last sends on"
            outbound.send_digest(plan.step_id, digest, busy)
        if tr is not None:
            tr.phase(None)
        return output

    def _digest(self, plan: StepPlan, view: StepView, post: np.ndarray, incoming) -> Digest:
        """The neighbour check (the previous stages' digest against the plan's expectation),
        then this stage's own state folded in. A stage never checks its own digest: the next
        stage or the driver does."""
        spec = self.spec
        if incoming is None:
            received = Digest.start(plan.step_id)
        else:
            received = incoming.digest()
            check_digest(
                received, plan.expected_state, step_id=plan.step_id,
                num_stages=spec.num_stages, upto=spec.index, check="neighbour",
                found_by=f"stage {spec.index}",
            )  # fmt: skip
        pool = self.pooler.state() if self.pooler is not None else (empty_ids(), empty_ids())
        state = self.mirror.state(plan, view, post, pool)
        if len(plan.media):  # the M-RoPE positions and image rows this stage applied
            state = replace(state, media=plan.media)
        return received.extend(state.parts(plan.step_id))

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
                check="mirror",
                found_by=f"stage {self.spec.index}, before computing",
            )

    def _forward(self, plan: StepPlan, view: StepView, incoming) -> tuple[torch.Tensor, PooledStep]:
        """Build the batch from the mirror, upload it in one copy, forward; on the last stage
        also pool. Returns (hidden [T, H], pooled outputs)."""
        model, spec = self.model, self.spec
        kv_rows = view.entry_rows if model.causal else None
        keys = step_key_lens(plan, view.lens)  # None unless some request keys a prefix
        if keys is not None and (model.causal or not self.takes_key_lengths):
            raise ValueError(
                f"stage {spec.index}, step {plan.step_id}: key lengths (ColBERT query expansion) "
                f"are not supported by this model's attention ({type(model).__name__})"
            )
        batch = build_host_batch(
            view.starts, view.lens, view.prompt_lens, kv_rows, view.block_tables,
            self.config.block_size, keys,
        )  # fmt: skip
        prep = keep = None
        types = plan.token_type_ids if spec.is_first and len(plan.token_type_ids) else None
        pools = self.pooler is not None  # the last stage (or a subclass's choice: _pools)
        if pools:
            prep = Pooler.prepare(plan.req_ids, view, batch.cu_q, by_segments=self.mean_by_segments)
            if spec.is_last and model.keeps_rows and prep.picks_only:
                # A step with no pick (every prompt mid-way) keeps a row all the same: the
                # forward's shapes stay non-empty, and the pooler reads none of it.
                keep = prep.pick_rows if len(prep.pick_rows) else np.zeros(1, np.int64)
        # A vision tower's plans carry one row of packed pixel values per position
        # (models/tower_vision.py): flat here, so they ride the one upload with the rest.
        ids = plan.token_ids.reshape(-1) if spec.is_first else None
        # A vision-language model's M-RoPE positions and image rows (core/media.py).
        media = plan.media.reshape(-1) if len(plan.media) else None
        extra: list[np.ndarray | None] = [ids, types, keep, media]
        if prep is not None:
            extra += prep.upload_arrays()
        inputs, uploaded = to_step_inputs(
            batch, self.uploader, causal=model.causal, extra=extra,
            attn_block_rows=self.attn_block_rows,
        )  # fmt: skip
        inputs.token_type_ids, inputs.keep_rows = uploaded[1], uploaded[2]
        if uploaded[3] is not None:
            inputs.media = uploaded[3].view(-1, plan.media.shape[1])
        tr = self.trace
        if tr is not None and not spec.is_first:
            tr.phase("receive")
        x = uploaded[0] if spec.is_first else self._received(plan, incoming)
        kv = self.kv_cache.layers() if self.kv_cache is not None else None
        if tr is not None:
            tr.phase("compute")  # on CUDA: queueing the kernels; on CPU: computing
            mark = tr.begin_device()
        self.clock.start()
        with torch.inference_mode(), batch_invariant(self.config.batch_invariant):
            if self.image_features is not None:
                inputs.image_embeds = self.image_features.step_rows(plan, model.encode_images)
            hidden = self.forward(x, inputs, kv)
            pooled = PooledStep.empty()
            if tr is not None:
                tr.end_device(mark, "forward")
            if pools:
                assert self.pooler is not None and prep is not None  # both set when pooling
                if tr is not None:
                    mark = tr.begin_device()
                pooled = self.pooler.pool(
                    hidden, prep, uploaded[4:], plan.req_ids, view, batch.cu_q,
                    picks=keep is not None,
                )  # fmt: skip
                if tr is not None:
                    tr.end_device(mark, "pool")
        self.clock.stop()
        return hidden, pooled

    def _received(self, plan: StepPlan, incoming) -> torch.Tensor:
        """The previous stage's rows for ``plan``, checked against the count the plan implies
        (the hidden states, then Qwen3-VL's DeepStack rows of the plan's image tokens): rows
        of another step's images are never added to this step's tokens."""
        hidden = incoming.hidden()
        want = self.model.received_rows(plan)
        if len(hidden) != want:
            raise StateDivergence(
                step_id=plan.step_id, stage=self.spec.index, request_id=-1, expected=want,
                found=len(hidden), check="neighbour", found_by=f"stage {self.spec.index}",
                what="rows received from the previous stage (hidden states, then DeepStack "
                "rows of the plan's image tokens)",
            )  # fmt: skip
        return hidden

    def _pools(self) -> bool:
        """Whether this stage keeps pooling state and pools: the last one only."""
        return self.spec.is_last

    def _view(self, plan: StepPlan) -> StepView:
        """The plan's requests as this stage's mirror holds them (new ones registered)."""
        return self.mirror.view(plan)

    def _post_step(self, view: StepView) -> np.ndarray:
        """Advance every scheduled request by its chunk, on every stage, whatever the forward
        returned; returns their num_computed_tokens after the step."""
        return self.mirror.advance(view)

    def _drop(self, plan: StepPlan, view: StepView) -> None:
        """Forget the requests that finished or were aborted (mirror and pooling state)."""
        for rid in self.mirror.drop(plan, view, freed=True):
            if self.pooler is not None:
                self.pooler.drop(rid)
        if self.image_features is not None:  # rows of requests whose last chunk this was
            self.image_features.keep(self.mirror.entries)


def new_runner(deployment: Deployment, spec: StageSpec) -> StageRunner:
    """Load stage ``spec`` (one of ``deployment.stage_spec``'s): its ``StageRunner``."""
    return StageRunner(deployment.config, deployment.folder, spec)


def _allocate(model: torch.nn.Module, device: torch.device) -> None:
    """``model.to_empty(device)`` by hand: ``to_empty`` calls ``empty_like`` on every meta
    tensor, which goes through ``torch._refs`` and imports sympy and torch.fx on first use
    (0.7 s of every start on the CPU); ``torch.empty`` of the same shape does not."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                empty = torch.empty(p.shape, dtype=p.dtype, device=device)
                module._parameters[name] = torch.nn.Parameter(empty, p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)


def current_device(device: torch.device) -> AbstractContextManager:
    """Kernels that take the current device (Triton, CUDA graphs) must see the stage's: in-process
    stages on several GPUs share one process, so each loads and steps inside this."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def load_stage_model(
    config: EngineConfig, folder: ModelFolder, spec: StageSpec, *, compile_now: bool
) -> StageModel:
    """Build the stage's modules without allocating them, then fill them from the checkpoint."""
    family = family_of(folder.architecture)
    with torch.device("meta"):
        model = family.build(
            folder.hf_config, spec.layers, spec.is_first, spec.is_last, spec.max_model_len,
            spec.classifier, causal=spec.causal,
        )  # fmt: skip
    assert model.causal == spec.causal
    model = model.to(dtype=spec.dtype)
    _allocate(model, spec.device)
    model.reset_buffers()
    checkpoint = Checkpoint(folder.path, family)
    checkpoint.load_stage(model)
    checkpoint.close()
    model.eval()
    if spec.int8_linears:
        model.quantize_int8()
    # Kernels are the deployment's choice (made once for every stage). The fused kernels still
    # check themselves against torch's ops on this stage's weights: a kernel that disagrees
    # here is not used (numerically the same op, only slower).
    model.attn_kernel = spec.attn_kernel
    if spec.fused_kernels and model.has_fused_kernels() and not model.use_fused_kernels():
        warnings.warn(
            f"stage {spec.index}: a fused kernel disagrees with torch ops on {spec.device}; "
            "this stage computes that part with torch ops",
            stacklevel=2,
        )
    if compile_now:
        body = compiled_layer_body(model, lambda m: warm_up(m, spec, config.block_size), spec)
        if body is not None:
            model.use_layer_body(body)
    return model


def warm_up(model: StageModel, spec: StageSpec, block_size: int, num_tokens: int = 64) -> None:
    """One forward of a dummy single-chunk request (no KV cache traffic), so compilation
    happens at load time rather than inside the first real step."""
    n = np.array([num_tokens])
    batch = build_host_batch(np.array([0]), n, n, None, [], block_size)
    inputs, _ = to_step_inputs(
        batch, DeviceUploader(spec.device), causal=model.causal, extra=[],
        attn_block_rows=model.attention_block_rows(),
    )  # fmt: skip
    if spec.is_first:
        x = torch.zeros(num_tokens, dtype=torch.int64, device=spec.device)
    else:
        x = torch.randn(num_tokens, model.hidden_size, dtype=spec.dtype, device=spec.device)
    with torch.inference_mode():
        model(x, inputs, None)
