"""Everything decided before a stage starts: model limits, default heads, devices, layer
split, KV-cache size, and every "auto" option (compile, CUDA graphs, running ahead, request
cap). Computed once on the driver and shipped (pickled) to every stage, so no process decides
an option on its own."""

from __future__ import annotations

import gc
import hashlib
import json
import warnings
from dataclasses import dataclass, fields

import torch

from ..config import EngineConfig, split_layers
from ..core.classifier_head import ClassifierHead
from ..errors import InvalidInputError, ModelLoadError
from ..layers import cpu_linear, int8_linear, qk_rope
from ..layers.attention import choose_kernel
from ..models import Family, StageModel, family_of
from ..models.base import kv_bytes_per_token
from ..models.checkpoint_math import check_config, decide_causal
from .classifier import read_classifier
from .invariance import check_batch_invariant
from .model_folder import ModelFolder, read_model_folder, tower_folder
from .retrieval import RetrievalHead, SpladeHead, outputs_of, read_retrieval
from .stage_spec import StageSpec
from .weights import Checkpoint

_CPU_KV_BYTES = 4 << 30  # address space reserved for the KV cache per stage on CPU
# Default token budget of a step (EngineConfig.max_num_batched_tokens). On CUDA at least
# TEI's 16384, and for small models as many tokens as make a step ~2 TFLOP, up to 65536: the
# host's work per step is roughly fixed (~2.7 ms on the H200 machine: scheduling, inputs,
# pooling, delivery), so a step of MiniLM-sized compute must be larger for the device, not
# the host, to set the pace. Measured on an H200, MiniLM shape, engine only, tok/s at 32k /
# 48k / 64k (two processes each): W4 10.8-9.5M / 12.0M / 11.4-12.0M, W1 12.2M / 12.5M / 12.5M
# (docs/benchmarks/gpu-short-inputs.md; with the device 2.05 ms a 32k step, the host set the
# pace there). Only models of MiniLM's size (~20 MFLOP a token) reach 64k; bge-small gets 32k.
# On CPU, steps whose activations stay in cache (2048 measured 1.4x faster than 16384).
_CUDA_STEP_TOKENS = 16384
_CUDA_MAX_STEP_TOKENS = 65536
_CPU_STEP_TOKENS = 2048
# The share of a GPU's free memory the engines plan to use, and what each process on it costs
# besides its weights, activations and KV cache (its CUDA context, the allocator's slack).
GPU_MEMORY_UTILIZATION = 0.90
_GPU_OVERHEAD_BYTES = 1 << 30
# What a process running a CPU pipeline holds besides its weights (torch, the tokenizer).
_CPU_PROCESS_BYTES = 512 << 20


@dataclass(frozen=True)
class Deployment:
    """Every decision made for one engine before any stage starts: the checkpoint's math
    (``causal``), model limits, default heads, devices, layer split, KV-cache size, kernels
    and every "auto" option. Made once on the driver (``plan_deployment``), shipped pickled
    to every stage, which checks its ``fingerprint``; immutable."""

    config: EngineConfig
    folder: ModelFolder
    # The checkpoint's attention (models/checkpoint_math.py): causal prompts chunk across steps
    # and keep a KV cache; bidirectional ones (encoders, is_causal=false decoders) run whole.
    causal: bool
    hidden_size: int
    output_dim: int  # size of a pooled vector (after any Dense head)
    vocab_size: int
    max_model_len: int
    pooling: str  # default for embed(): last | mean | cls
    normalize: bool  # default L2 normalisation of embed()
    dtype: torch.dtype
    devices: tuple[str, ...]  # one per stage
    layers: tuple[range, ...]  # one per stage
    kv_cache_tokens: int  # 0 for encoders
    num_kv_blocks: int
    max_num_batched_tokens: int  # token budget of one step
    max_num_seqs: int  # requests in one step
    compile: bool  # torch.compile the layer bodies
    graph_max_tokens: int  # largest step replayed as CUDA graphs; 0: none
    # Compile while the engine already serves (stage/background_compile.py): where ``compile``
    # was left to the engine and the stages run in this process.
    compile_in_background: bool
    overlap_steps: bool  # multi-process pipeline runs one plan ahead of its devices
    # Each enqueued slice of a call runs longest prompt first (results still come back in input
    # order). On the CPU an encoder attends in one kernel call per run of equal-length
    # requests (layers/grouped_attention.py), so steps of equal lengths make fewer, longer
    # calls: +6% texts/s on 2,000 texts (docs/benchmarks/cpu.md). On CUDA the
    # varlen kernels do not care, and decoders chunk prompts across steps: input order.
    length_sorted: bool
    # Attention kernel (portable | flash | varlen) and the fused Triton kernels of the layer
    # bodies (q/k-norm + RoPE; Gemma's GeGLU), chosen by self-checks on the planning process's
    # device: every stage runs the same kernels.
    attn_kernel: str = "portable"
    fused_kernels: bool = False
    # EngineConfig.dtype "int8": the encoder's linear layers run as dynamic int8 GEMMs on the
    # CPU (layers/int8_linear.py); ``dtype`` is float32, what every other tensor keeps.
    int8_linears: bool = False
    # "all": the planning process sees every stage's device (``devices`` names them);
    # "local": torchrun, each rank takes ``cuda:LOCAL_RANK`` of its own host (``devices`` says
    # only the kind), so no host needs to see as many GPUs as there are stages.
    placement: str = "all"
    # A classifier's head (cross-encoders, rerankers; classifier.py); None: an embedding model.
    # Its outputs are num_labels scores (output_dim), its pooling the head's own token.
    classifier: ClassifierHead | None = None
    # Sparse and multi-vector heads (retrieval.py): SPLADE, BGE-M3, ColBERT; None: dense only.
    retrieval: RetrievalHead | None = None

    @property
    def outputs(self) -> tuple[str, ...]:
        """What the model gives per text: dense | sparse | multi_vector (retrieval.OUTPUTS)."""
        return outputs_of(self.retrieval)

    @property
    def num_stages(self) -> int:
        return len(self.layers)

    def stage_spec(self, index: int, local_rank: int | None = None) -> StageSpec:
        """Stage ``index`` as the process running it sees it; ``local_rank``: its place on its
        host under torchrun (placement "local")."""
        return StageSpec(
            index=index,
            num_stages=self.num_stages,
            layers=self.layers[index],
            device=self.stage_device(index, local_rank),
            dtype=self.dtype,
            num_kv_blocks=self.num_kv_blocks,
            max_model_len=self.max_model_len,
            compile=self.compile,
            graph_max_tokens=self.graph_max_tokens,
            compile_in_background=self.compile_in_background,
            classifier=self.classifier,
            retrieval=self.retrieval,
            attn_kernel=self.attn_kernel,
            fused_kernels=self.fused_kernels,
            causal=self.causal,
            int8_linears=self.int8_linears,
        )

    def stage_device(self, index: int, local_rank: int | None = None) -> torch.device:
        kind = self.devices[index]
        if self.placement == "all" or kind == "cpu":
            return torch.device(kind)
        local = local_rank or 0
        count = torch.cuda.device_count()
        if local >= count:
            raise InvalidInputError(
                f"stage {index} runs as LOCAL_RANK {local} but this host sees {count} GPU(s) "
                "(CUDA_VISIBLE_DEVICES); start at most that many processes per node",
                param="pipeline_parallel_size",
            )
        return torch.device("cuda", local)

    def fingerprint(self) -> str:
        """A digest of every decision in the plan, computed from the fields (not from pickled
        bytes), so two processes that unpickled the same plan differently disagree."""
        parts = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.name != "folder"]
        folder = self.folder
        parts.append(f"folder={folder.path}|{folder.architecture}|")
        parts.append(json.dumps(folder.hf_config, sort_keys=True, default=str))
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def plan_deployment(
    config: EngineConfig, *, local_placement: bool = False, gpu_free_bytes: int | None = None
) -> Deployment:
    """Every decision, made once. ``local_placement``: torchrun, each rank on its host's
    ``cuda:LOCAL_RANK``; then ``gpu_free_bytes`` is the least free memory any rank reported
    (this process sees only its own GPU)."""
    device_kind = resolve_device_kind(config.device)
    parts = _read_model(config, device_kind)
    folder, family, hf, causal = parts.folder, parts.family, parts.hf, parts.causal
    dtype, checkpoint, classifier, whole = (
        parts.dtype,
        parts.checkpoint,
        parts.classifier,
        parts.whole,
    )
    int8 = config.dtype == "int8"

    max_len = _max_model_len(config, folder, whole.max_positions)
    st = folder.st
    if whole.fixed_pooling and config.pooling is not None:
        raise InvalidInputError(
            f"{folder.architecture} pools as its checkpoint does; pooling cannot be set",
            param="pooling",
        )
    pooling = config.pooling or (st.pooling if st and st.pooling else None)
    pooling = pooling or family.default_pooling
    normalize = config.normalize if config.normalize is not None else (st.normalize if st else True)
    output_dim = st.dense[-1].out_features if st and st.dense else whole.output_size
    if classifier is not None:
        if config.pooling is not None:
            raise InvalidInputError(
                f"{folder.architecture} pools the token its head reads; pooling cannot be set",
                param="pooling",
            )
        # The head reads the row its checkpoint says (ModernBERT: cls or mean), else the
        # [CLS] / <s> row of an encoder and the last token of a decoder; "normalize" is its
        # activation, on unless switched off.
        pooling = classifier.pooling or family.default_pooling
        if classifier.per_token:
            pooling = "all"  # logits for every token
        normalize = config.normalize if config.normalize is not None else True
        output_dim = classifier.num_labels
    retrieval = None
    if classifier is None:
        retrieval = read_retrieval(folder, family.name, checkpoint.entries, whole.hidden_size)
    if isinstance(retrieval, SpladeHead):
        if config.pooling is not None:
            raise InvalidInputError(
                "a SparseEncoder pools as its SpladePooling says; pooling cannot be set",
                param="pooling",
            )
        pooling, output_dim = retrieval.pooling, retrieval.vocab_size
        normalize = config.normalize if config.normalize is not None else False

    layers = tuple(
        split_layers(whole.num_layers, config.pipeline_parallel_size, config.pp_partition)
    )
    cuda = device_kind == "cuda"
    if local_placement:
        devices = (device_kind,) * len(layers)
    else:
        devices = _stage_devices(device_kind, len(layers))
    local = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    attn_kernel = choose_kernel(local, dtype, whole.attention_shape)
    check_batch_invariant(
        config, family, device_kind, attn_kernel,
        type(retrieval).__name__ if retrieval is not None else None,
    )  # fmt: skip
    fused = attn_kernel != "portable" and family.decoder and qk_rope.available(local, dtype)
    per_token = flops_per_token(family, checkpoint)
    budget = step_tokens(config, cuda, per_token)
    graphs = _cuda_graphs(config, cuda, whole.graph_safe_with(attn_kernel))
    graph_tokens = (
        _graph_max_tokens(budget, per_token, invariant=config.batch_invariant) if graphs else 0
    )
    kv_tokens = 0
    if causal:
        pool_tokens = _graph_pool_tokens(config, graphs, budget, per_token)
        kv_tokens = _kv_cache_tokens(
            config, budget, pool_tokens, family, checkpoint, whole, layers, dtype, devices,
            gpu_free_bytes,
        )  # fmt: skip
    block = config.block_size
    return Deployment(
        config=config,
        folder=folder,
        causal=causal,
        hidden_size=whole.hidden_size,
        output_dim=output_dim,
        vocab_size=family.vocab_size(hf),
        max_model_len=max_len,
        pooling=pooling,
        normalize=normalize,
        dtype=dtype,
        devices=devices,
        layers=layers,
        kv_cache_tokens=kv_tokens,
        num_kv_blocks=-(-kv_tokens // block) if kv_tokens else 0,
        max_num_batched_tokens=budget,
        max_num_seqs=config.max_num_seqs or budget,
        compile=_compile(config, cuda and not config.batch_invariant, whole),
        compile_in_background=(
            config.compile is None
            and cuda
            and not config.batch_invariant
            and whole.compiles
            and (len(layers) == 1 or config.pipeline_backend == "inproc")
        ),
        graph_max_tokens=graph_tokens,
        overlap_steps=_auto(config.overlap_steps, cuda),
        length_sorted=not cuda and not causal,
        classifier=classifier,
        retrieval=retrieval,
        attn_kernel=attn_kernel,
        fused_kernels=fused,
        int8_linears=int8,
        placement="local" if local_placement else "all",
    )


@dataclass(frozen=True)
class _ModelParts:
    """A checkpoint as read and checked for a config, before any decision about running it:
    its folder and family, the math it asks for, the dtype it runs in on ``device_kind``,
    its weights' index and the whole model built on the meta device."""

    folder: ModelFolder
    family: Family
    hf: dict
    causal: bool
    dtype: torch.dtype
    checkpoint: Checkpoint
    classifier: ClassifierHead | None
    whole: StageModel


def _read_model(config: EngineConfig, device_kind: str) -> _ModelParts:
    folder = tower_folder(read_model_folder(config.model), config.tower)
    family = family_of(folder.architecture)
    hf = folder.hf_config
    check_config(hf, family=family.name, decoder=family.decoder, architecture=folder.architecture)
    causal = decide_causal(
        hf, family=family.name, decoder=family.decoder, attention=config.attention
    )
    dtype = _dtype(config.dtype, hf, device_kind)
    if config.dtype == "int8":
        _check_int8(config, family, hf, causal, device_kind)
    checkpoint = Checkpoint(folder.path, family)
    classifier = read_classifier(
        folder,
        family=family.name,
        decoder=family.decoder,
        head_kind=family.head_kind,
        reranker=config.reranker,
        checkpoint_names=checkpoint.entries,
        model_name=config.model,
    )
    with torch.device("meta"):
        whole = family.build(
            hf, range(family.num_layers(hf)), True, True, 1, classifier, causal=causal
        )
    checkpoint.verify(whole.weight_specs())
    return _ModelParts(folder, family, hf, causal, dtype, checkpoint, classifier, whole)


@dataclass(frozen=True)
class ModelMemory:
    """What one pipeline of a model needs on the device of its largest stage, in bytes, as the
    engine budgets it: that stage's weights, a step's working set, what each process costs
    besides (a CUDA context, allocator slack), and its KV cache, of ``kv_bytes_per_token``
    a token (0: no KV cache, a bidirectional model). ``min_kv_tokens``: the least KV it can
    run with (its longest prompt and a step's tokens, in whole blocks); ``kv_cache_tokens``:
    what the config fixes, if it does."""

    weights: int
    activations: int
    overhead: int
    kv_bytes_per_token: int
    min_kv_tokens: int
    kv_cache_tokens: int | None

    @property
    def fixed(self) -> int:
        """Everything but the KV cache."""
        return self.weights + self.activations + self.overhead


def memory_needs(config: EngineConfig, device_kind: str) -> ModelMemory:
    """``ModelMemory`` of a config's model on ``device_kind`` ("cuda" or "cpu"), from its
    checkpoint's index: no weight is read and no device touched."""
    parts = _read_model(config, device_kind)
    whole, family = parts.whole, parts.family
    layers = split_layers(whole.num_layers, config.pipeline_parallel_size, config.pp_partition)
    cuda = device_kind == "cuda"
    per_step = flops_per_token(family, parts.checkpoint)
    budget = step_tokens(config, cuda, per_step)
    graphs = _graph_pool_tokens(config, cuda and _auto(config.cuda_graphs, cuda), budget, per_step)
    largest = max(len(r) for r in layers)
    weights = _stage_weight_bytes(parts.checkpoint, family, layers, whole.num_layers, parts.dtype)
    per_token = 0
    least = 0
    if parts.causal:
        assert whole.kv_layout is not None, "a causal model keeps a KV cache"
        per_token = kv_bytes_per_token(whole.kv_layout, largest, parts.dtype)
        longest = _max_model_len(config, parts.folder, whole.max_positions) + budget
        least = -(-longest // config.block_size) * config.block_size
    return ModelMemory(
        weights=int(weights),
        activations=_working_set_bytes(budget, graphs, whole, largest, parts.dtype),
        overhead=_GPU_OVERHEAD_BYTES if cuda else _CPU_PROCESS_BYTES,
        kv_bytes_per_token=per_token,
        min_kv_tokens=least,
        kv_cache_tokens=config.kv_cache_tokens,
    )


def step_tokens(config: EngineConfig, cuda: bool, flops_per_token: float) -> int:
    """The token budget of a step: the user's, or the default for the device and model."""
    if config.max_num_batched_tokens:
        return config.max_num_batched_tokens
    if not cuda:
        return _CPU_STEP_TOKENS
    return min(max(_pow2_at_most(_STEP_FLOPS / flops_per_token), _CUDA_STEP_TOKENS),
               _CUDA_MAX_STEP_TOKENS)  # fmt: skip


def _cuda_graphs(config: EngineConfig, cuda: bool, graph_safe: bool) -> bool:
    """CUDA graphs where asked for (or on CUDA by default) and the model can be captured."""
    if config.cuda_graphs and not graph_safe:
        raise InvalidInputError(
            f"{config.model}: this model's attention reads each step's offsets on the host and "
            "cannot be captured as CUDA graphs; leave cuda_graphs to the engine or set it off",
            param="cuda_graphs",
        )
    return _auto(config.cuda_graphs, cuda) and graph_safe


def _compile(config: EngineConfig, cuda: bool, whole: StageModel) -> bool:
    """torch.compile where asked for (or on CUDA by default) and the family has a body to
    compile; asked for on one that has none, refused by name."""
    if config.compile and not whole.compiles:
        raise InvalidInputError(
            f"{config.model}: this model's layers run eagerly (no compiled layer body); leave "
            "compile to the engine or set it off",
            param="compile",
        )
    return _auto(config.compile, cuda) and whole.compiles


def _auto(wanted: bool | None, default: bool) -> bool:
    return default if wanted is None else wanted


# A CUDA graph saves the host a few microseconds per kernel launch but pads a step up to its
# bucket (12% on average): worth it while a step is short enough for launches to matter.
# Steps up to ~2 TFLOP (a few ms of an H200) are replayed; larger ones run eagerly. The same
# size bounds the default budget of small models from below (``step_tokens``).
_STEP_FLOPS = 2e12
_INVARIANT_GRAPH_FACTOR = 16
_GRAPH_MIN_TOKENS = 512


def flops_per_token(family: Family, checkpoint: Checkpoint) -> float:
    """Forward FLOPs per token of the linear layers (2 per weight; embeddings excluded)."""
    params = sum(
        _numel(e.shape)
        for name, e in checkpoint.entries.items()
        if not family.ignored.match(name) and not _is_embedding(name)
    )
    return max(2.0 * params, 1.0)


def linear_weight_shapes(family: Family, checkpoint: Checkpoint) -> list[tuple[int, ...]]:
    """The shape of each 2-D weight ``flops_per_token`` counts: the model's matmuls."""
    return [
        tuple(e.shape)
        for name, e in checkpoint.entries.items()
        if len(e.shape) == 2 and not family.ignored.match(name) and not _is_embedding(name)
    ]


def _is_embedding(name: str) -> bool:
    """A lookup table, not a matmul (T5 calls its token embedding ``shared``)."""
    return "embed" in name or name == "shared.weight" or "relative_attention_bias" in name


def _graph_max_tokens(budget: int, per_token: float, *, invariant: bool) -> int:
    """Largest step (tokens) worth a CUDA graph: ~2 TFLOP, or ``_INVARIANT_GRAPH_FACTOR``
    times that for a batch-invariant forward, which runs uncompiled, each op launched from
    Python through its mode (measured on an H100, Qwen3-0.6B shape: replaying its steps up to
    16,384 tokens, ~15 TFLOP, took its cost against the default from 10-24% to under 1%)."""
    flops = _STEP_FLOPS * (_INVARIANT_GRAPH_FACTOR if invariant else 1)
    return min(budget, max(_pow2_at_most(flops / per_token), _GRAPH_MIN_TOKENS))


def _graph_pool_tokens(config: EngineConfig, graphs: bool, budget: int, per_token: float) -> int:
    """The largest step whose graphs' pool the working set holds (``_working_set_bytes``):
    the batch-invariant forward's graph bound where ``graphs`` run, its steps far larger than
    the default's (whose pools the process overhead covers), else 0."""
    if not (graphs and config.batch_invariant):
        return 0
    return _graph_max_tokens(budget, per_token, invariant=True)


def _pow2_at_most(x: float) -> int:
    return 1 << max(int(x).bit_length() - 1, 0)


def resolve_device_kind(device: str) -> str:
    """cpu or cuda: what ``EngineConfig.device`` means on this host."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = device.split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise InvalidInputError(f"device must be auto, cpu or cuda, got {device!r}", param="device")
    if kind == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError(
            "device cuda was asked for but CUDA is not available", param="device"
        )
    return kind


def _dtype(name: str, hf: dict, device_kind: str) -> torch.dtype:
    if name == "int8":
        return torch.float32  # only the linear layers' GEMMs are int8 (int8_linears)
    if name != "auto":
        dtype = getattr(torch, name)
        if device_kind == "cpu" and dtype in (torch.bfloat16, torch.float16):
            _warn_if_emulated(dtype)
        return dtype
    if device_kind == "cpu":
        return torch.float32  # the reference precision; CPU half-precision matmuls are slow
    stored = hf.get("dtype", hf.get("torch_dtype"))
    return torch.float16 if stored == "float16" else torch.bfloat16


def _warn_if_emulated(dtype: torch.dtype) -> None:
    """Half precision on a CPU that emulates it runs every matmul several times slower than
    float32 (bfloat16 at 0.13x float32 measured on an AVX2-only EPYC): say so, once."""
    if not cpu_linear.native_half(dtype):
        name = str(dtype).removeprefix("torch.")
        warnings.warn(
            f"dtype {name} on a CPU without native {name} (no AVX-512 {name} or AMX): it is "
            "emulated and runs several times slower than float32, the CPU default",
            RuntimeWarning,
            stacklevel=3,
        )


def _check_int8(
    config: EngineConfig, family: Family, hf: dict, causal: bool, device_kind: str
) -> None:
    """dtype int8: a CPU encoder whose layers have the int8 path, on a CPU whose int8 kernel
    passes its self-check, run eagerly."""
    if device_kind != "cpu":
        raise InvalidInputError(
            "dtype int8 runs on the CPU only (dynamic int8 linear layers); on CUDA use "
            "bfloat16 or float16",
            param="dtype",
        )
    if not family.supports_int8(hf, causal):
        raise InvalidInputError(
            f"dtype int8 is not available for the {family.name} family: its CPU path has no "
            "int8 linear layers (BERT-family encoders do: bert, roberta, distilbert, electra)",
            param="dtype",
        )
    if config.compile:
        raise InvalidInputError(
            "dtype int8 runs its layers eagerly; compile cannot be set with it", param="compile"
        )
    if not int8_linear.supported():
        raise InvalidInputError(
            "dtype int8 is not supported on this machine: PyTorch's FBGEMM int8 linear is "
            "missing or disagrees with float32 beyond int8 rounding (it needs an x86 CPU with "
            "AVX512-VNNI or AVX-VNNI)",
            param="dtype",
        )


def _stage_devices(kind: str, num_stages: int) -> tuple[str, ...]:
    if kind == "cpu":
        return ("cpu",) * num_stages
    count = torch.cuda.device_count()
    if count < num_stages:
        raise InvalidInputError(
            f"pipeline_parallel_size={num_stages} needs {num_stages} GPUs, {count} visible",
            param="pipeline_parallel_size",
        )
    return tuple(f"cuda:{k}" for k in range(num_stages))


def _max_model_len(config: EngineConfig, folder: ModelFolder, model_limit: int) -> int:
    if config.max_model_len is not None:
        if config.max_model_len > model_limit:
            raise InvalidInputError(
                f"max_model_len={config.max_model_len} is above the model's limit of {model_limit} "
                "positions",
                param="max_model_len",
            )
        return config.max_model_len
    st_limit = folder.st.max_seq_length if folder.st else None
    return min(model_limit, st_limit) if st_limit else model_limit


def _kv_cache_tokens(
    config, budget: int, pool_tokens: int, family: Family, checkpoint, whole, layers, dtype,
    devices, free_bytes,
) -> int:  # fmt: skip
    """Tokens of KV every stage can hold: the user's number, or what memory allows beside
    the working set (``_working_set_bytes``)."""
    largest = max(len(r) for r in layers)
    per_token = kv_bytes_per_token(whole.kv_layout, largest, dtype)
    if config.kv_cache_tokens is not None:
        tokens = config.kv_cache_tokens
    elif devices[0] == "cpu":
        tokens = _CPU_KV_BYTES // per_token
    else:
        tokens = _gpu_kv_tokens(
            config, budget, pool_tokens, checkpoint, family, whole, layers, dtype, devices,
            per_token, free_bytes,
        )  # fmt: skip
    if tokens < config.block_size:
        raise ModelLoadError(f"KV cache of {tokens} tokens is smaller than one block")
    return tokens


def _gpu_kv_tokens(
    config, step_tokens, pool_tokens, checkpoint, family, whole, layers, dtype, devices,
    per_token, free_bytes,
) -> int:  # fmt: skip
    """What is left of the smallest GPU after the largest stage's weights and a working set
    for one step's activations (set by the token budget)."""
    stage_weights = _stage_weight_bytes(checkpoint, family, layers, whole.num_layers, dtype)
    largest = max(len(r) for r in layers)
    activations = _working_set_bytes(step_tokens, pool_tokens, whole, largest, dtype)
    if free_bytes is None:
        free_bytes = min(free_gpu_bytes(torch.device(d)) for d in devices)
    # Replicas sharing a GPU (replicas_per_gpu) each budget their share of it.
    usable = free_bytes * GPU_MEMORY_UTILIZATION * config.gpu_memory_share
    budget = usable - stage_weights - activations - _GPU_OVERHEAD_BYTES
    if budget < per_token * config.block_size:
        raise ModelLoadError(
            f"not enough GPU memory for the KV cache: {free_bytes / 2**30:.1f} GiB free, weights "
            f"{stage_weights / 2**30:.1f} GiB, step working set {activations / 2**30:.1f} GiB"
        )
    return int(budget // per_token)


def _stage_weight_bytes(checkpoint, family, layers, num_layers: int, dtype) -> float:
    """Bytes of the largest stage's weights: the model's, in proportion to its layers."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    weights = sum(
        _numel(e.shape) for name, e in checkpoint.entries.items() if not family.ignored.match(name)
    )
    return weights * itemsize * max(len(r) for r in layers) / num_layers


def free_gpu_bytes(device: torch.device | None = None) -> int:
    """Memory a new engine may take on ``device``: the driver's free memory once this process's
    allocator has given back what it holds unused. An engine closed earlier in the same
    process leaves its blocks (and its graphs' pools, kept by reference cycles until a
    collection) there, where the driver counts them as taken."""
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def _working_set_bytes(step_tokens: int, pool_tokens: int, whole, stage_layers: int, dtype) -> int:
    """Memory a stage's steps work in: one step's activations, and where ``pool_tokens`` (the
    largest step of the batch-invariant forward's graphs, 0 for none) the graphs' private pool
    at that bucket: a step's activations again, and what each layer's pieces keep between
    them (``_piece_widths``; on the 0.6B shape at 16,384 tokens, 9.5 GB in all, which the
    H100 runs captured in)."""
    eager = _activation_bytes(step_tokens, whole, dtype)
    if not pool_tokens:
        return eager
    itemsize = torch.empty((), dtype=dtype).element_size()
    pieces = pool_tokens * stage_layers * _piece_widths(whole) * itemsize
    return eager + _activation_bytes(pool_tokens, whole, dtype) + pieces


def _piece_widths(whole) -> int:
    """Values of one token a layer's graph pieces keep between them: its attention's q, k, v
    and output, and the hidden state and residual carried to the next piece."""
    carried = 2 * whole.hidden_size
    layout = whole.kv_layout
    if layout is None:  # an encoder: as many heads for keys as for queries
        return 4 * whole.hidden_size + carried
    query_heads = layout.num_kv_heads * whole.attention_shape.group
    return 2 * (query_heads + layout.num_kv_heads) * layout.head_dim + carried


def _activation_bytes(step_tokens: int, whole, dtype) -> int:
    """A working set for one step's activations, set by the token budget."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    hidden = whole.hidden_size
    inter = getattr(whole.cfg, "intermediate_size", 4 * hidden)
    return step_tokens * (8 * hidden + 4 * inter) * itemsize * 2


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
