"""Engine configuration: what the user asked for, checked once, before any process starts.

``EngineConfig`` is the one list of engine options. ``Engine(**options)`` fills it by field
name, and the command line derives its flags from the fields' metadata (``commands/common``),
so an option is declared here and nowhere else. "auto" values (``None``) are resolved once,
in ``deployment.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .core.classifier_head import RERANKERS
from .core.request import POOLING_NAMES
from .errors import InvalidInputError

# Every pooling a request may ask for, and those that give one vector per input (what a model's
# default pooling can be).
POOLING_TYPES = POOLING_NAMES
VECTOR_POOLINGS = tuple(p for p in POOLING_NAMES if p != "all")
# "int8": the CPU encoder's linear layers as dynamic int8 GEMMs, everything else float32
# (layers/int8_linear.py); an opt-in that trades a little quality for speed.
DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")
# What happens to an input longer than max_model_len: cut to fit (what sentence-transformers and
# TEI do by default), refused, or embedded window by window and combined (vLLM's chunked
# processing).
LONG_INPUTS = ("truncate", "error", "chunk")
# A checkpoint's attention: "auto" = what its config says (``is_causal``); the others override it,
# which a checkpoint whose auto_map names remote model code requires (models/checkpoint_math.py).
ATTENTION = ("auto", "causal", "bidirectional")
# Which tower of a dual encoder (CLIP, SigLIP) a pipeline runs; every other model is "text".
TOWERS = ("text", "vision")


def option(default, help: str, *, flag: str | None = None, cli: bool = True, **extra):
    """A config field with what the command line needs to offer it."""
    return field(default=default, metadata={"help": help, "flag": flag, "cli": cli, **extra})


def parse_partition(text: str | None) -> tuple[int, ...] | None:
    """``"10,18"`` -> ``(10, 18)``: layers per stage, as given on the command line."""
    if not text:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise InvalidInputError(
            f"--pp-partition takes comma-separated layer counts, got {text!r}", param="pp_partition"
        ) from None


@dataclass(frozen=True)
class EngineConfig:
    """Options shared by every front end (API, CLI, server). Frozen: one engine, one config."""

    model: str | None = option(
        None, "model folder or hub id (default: the bundled all-MiniLM-L6-v2)"
    )
    dtype: str = option(
        "auto",
        "auto: float32 on the CPU; on GPU float16 for float16 checkpoints, else bfloat16; "
        "int8: CPU encoders (BERT family) with dynamic int8 linear layers, the rest float32",
        choices=DTYPES,
    )
    device: str = option("auto", "auto | cpu | cuda (auto: cuda when available)")
    # None (decided in deployment.step_tokens): 16384 on CUDA (TEI's default), 32768 for
    # models small enough that a 16384-token step leaves the device waiting for the host;
    # 2048 on the CPU, where smaller steps run faster
    # (measured 1.4x texts/s on all-MiniLM with 2 cores: their activations stay in cache) and
    # results come back often enough for a progress bar to move.
    max_num_batched_tokens: int | None = option(
        None,
        "token budget of one step; longer prompts are chunked to fit (default: chosen per "
        "device and model: 2048 on the CPU; on CUDA about 2 TFLOP of work, at least 16384 "
        "tokens and at most 65536, e.g. 65536 for all-MiniLM-L6-v2)",
    )
    # Pooling has no decode phase: a step's size is bounded by tokens, as in TEI, and the
    # request count does not cap a step of short prompts below its token budget.
    max_num_seqs: int | None = option(
        None, "requests in one step (default: no cap beyond the token budget)"
    )
    max_model_len: int | None = option(
        None, "longest prompt (default: the model's, sentence-transformers max_seq_length first)"
    )
    long_inputs: str = option(
        "truncate",
        "inputs longer than max_model_len: truncate (as sentence-transformers and TEI do), "
        "error, or chunk (embed every max_model_len window, token-weighted mean)",
        choices=LONG_INPUTS,
    )
    pipeline_parallel_size: int = option(
        1, "pipeline stages (one process and, on GPU, one device each)", flag="--pp"
    )
    pp_partition: tuple[int, ...] | None = option(
        None,
        "layers per stage, e.g. 10,18 (sums to the model's layers; default: as even as "
        "possible, the first stages one layer more)",
        parse=parse_partition,
    )
    # Data parallelism: independent replicas of the whole pipeline, each with its own scheduler
    # in its own processes (replicas/), behind one front end that tokenises and routes. On GPU
    # replica r takes devices r*PP .. r*PP+PP-1, or shares them with replicas_per_gpu - 1 others.
    data_parallel_size: int = option(
        1,
        "replicas of the whole pipeline, each in its own processes (GPUs replica-major: "
        "replica r uses devices r*PP .. r*PP+PP-1)",
        flag="--dp",
    )
    replicas_per_gpu: int = option(
        1, "replicas sharing each GPU (small models: more host threads per device)"
    )
    # A replica's share of its GPUs' free memory for the KV cache (set per replica from
    # replicas_per_gpu; 1.0: all of it).
    gpu_memory_share: float = option(1.0, "", cli=False)
    # CPU threads this pipeline's stages split between them (a replica's share of the host's
    # cores, so N replicas do not oversubscribe them); None: every core.
    cpu_threads: int | None = option(None, "", cli=False)
    # How stages run when pipeline_parallel_size > 1: "mp", one process per stage (the real
    # thing); "inproc", all stages in this process, one after the other (tests, debugging).
    pipeline_backend: str = option("mp", "", cli=False)
    pooling: str | None = option(None, "override the model's pooling", choices=VECTOR_POOLINGS)
    normalize: bool | None = option(None, "override the model's default L2 normalisation")
    # How causal-LM checkpoints rerank (classifier.py): Qwen3-Reranker's prompt and yes/no
    # logits, or not at all; auto: by the checkpoint's name (Qwen3 checkpoints named *Reranker*).
    reranker: str = option(
        "auto",
        "causal-LM rerankers: qwen3 (Qwen3-Reranker's prompt and yes/no logits), none, or auto "
        "(qwen3 for Qwen3 checkpoints whose name contains 'reranker')",
        choices=RERANKERS,
    )
    attention: str = option(
        "auto",
        "the checkpoint's attention: auto (as its config says), or causal | bidirectional to "
        "override it; needed to run a checkpoint whose auto_map names remote model code as its "
        "built-in family",
        choices=ATTENTION,
    )
    # Dual encoders (CLIP, SigLIP) run each tower as a pipeline of its own: the engine opens
    # the vision tower's with tower="vision" (api/images.py); "text" is every other model.
    tower: str = option("text", "", cli=False)
    # Image inputs are untrusted (intake/images.py): local files only under this folder (vLLM's
    # --allowed-local-media-path), and no image over this many pixels is decoded.
    allowed_local_media_path: str | None = option(
        None,
        "image inputs may name files under this folder (default: none; data URIs, bytes and "
        "PIL images only)",
        metavar="DIR",
    )
    max_image_pixels: int = option(
        40_000_000,
        "largest image (width x height) decoded; larger ones are refused from their header, "
        "before decoding",
    )
    block_size: int = option(16, "tokens per KV-cache block", cli=False)
    kv_cache_tokens: int | None = option(
        None,
        "KV capacity in tokens, for causal models (default: on GPU what nine tenths of the "
        "free memory hold after the weights, a step's working set and 1 GiB; on the CPU 4 GiB "
        "worth)",
    )
    # A pipeline that heals: when a stage process dies, the engine starts the stages again and
    # runs the requests that were in flight once more (pooling is a pure function of a prompt,
    # so no caller sees the failure). More failures than this within 5 minutes: give up.
    stage_restarts: int = option(
        5, "restart the stage processes after one dies, up to N times in 5 minutes (0: fail)"
    )
    # A stage process that stops answering (stopped, deadlocked, a wedged device) would hold
    # every request forever: once the loop has waited on the stages past a bound they count as
    # dead, and the pipeline heals as for a killed stage (driver/watchdog.py). By default the
    # bound is learnt from the pipeline's own waits (WaitBound: max(10 s, 10x the longest recent
    # one)), so a stopped stage of a fast pipeline is seen in seconds and a slow one keeps room.
    step_timeout_s: float | None = option(
        None,
        "fixed bound, in seconds, on a wait for the stages (plus 10 ms per token of the step) "
        "before they count as hung and are restarted; 0: wait forever (default: learnt from "
        "the pipeline's own steps, max(10 s, 10x the longest of its recent waits), 60 s or "
        "more for its first steps; stage processes only, from a pipeline's first result on)",
    )
    # Every vector bit-identical whatever shares its step (batch-mates, token budget and chunk
    # boundaries, PP, DP replica, CUDA graphs): fixed-shape products and attention in fixed key
    # blocks (layers/invariant_ops.py, invariant_attention.py; docs/batch-invariance.md).
    batch_invariant: bool = option(
        False,
        "bit-identical vectors whatever else is in the batch, the token budget, PP or DP "
        "(fixed-shape matmuls, attention in fixed key blocks, no torch.compile; costs "
        "throughput: docs/batch-invariance.md)",
    )
    # Expected-state checks of docs/design.md §1 (mirror vs plan, digests between stages).
    verify_state: bool = option(
        True, "lockstep checks between stages (off only to measure their cost)"
    )
    # The interpreter's thread switch interval while an engine is open, and in a server's front
    # ends while they serve (switch_interval.py): the engine's loop thread must get the GIL
    # promptly from the threads that submit, or the GPU waits; an event loop from the threads
    # that serialise answers, or every request waits.
    switch_interval_ms: float = option(
        0.5,
        "Python thread switch interval (sys.setswitchinterval) while an engine is open and "
        "while a server's front ends serve, so that the engine's loop thread and the event "
        "loops are not kept waiting by other threads; 0 leaves it alone",
    )
    # Texts tokenised in helper processes of the engine's own (intake/tokenizer_pool.py): the
    # engine's process keeps its interpreter lock and its cores for the steps. None (decided
    # by ``tokenizer_pool.pool_size``): on a CUDA engine with 8 cores or more that owns its
    # pipeline, every core but two; else none, the Rust tokenizer's own threads in this
    # process. Not a flag: the server's front ends tokenise as they choose (server/front.py).
    tokenizer_processes: int | None = option(None, "", cli=False)
    compile: bool | None = option(None, "torch.compile the layers (default: on for CUDA)")
    # CUDA graphs replay a step's kernels without launching them one by one from Python:
    # captured per padded token count, the first time a step of that size runs.
    cuda_graphs: bool | None = option(
        None, "replay steps as CUDA graphs (default: on for CUDA where the model allows it)"
    )
    # Multi-process pipeline runs ahead of the devices: one plan more in flight than stages,
    # and the last stage sends step k's results only once step k+1 is queued on its device,
    # so no device waits for the host between steps. None: on for CUDA. Off on CPU, where
    # a step computes synchronously and running ahead would only hold results back.
    overlap_steps: bool | None = option(None, "", cli=False)
    # The step timeline: a Chrome trace-event file with one track per process
    # (driver, each stage), written when the engine closes or on ``Engine.write_trace``, and a
    # summary of where each stage's time went. Off (None), no step records anything.
    trace: str | None = option(
        None,
        "write a timeline of every step to FILE.json (Chrome trace events: open it in "
        "ui.perfetto.dev or chrome://tracing) and print where each stage's time went",
        metavar="FILE.json",
    )

    @classmethod
    def from_options(cls, **options) -> EngineConfig:
        """``EngineConfig(**options)``, naming an unknown option instead of a TypeError."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidInputError(
                f"unknown engine option {unknown[0]!r}; options are: {', '.join(sorted(known))}",
                param=unknown[0],
            )
        return cls(**options)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidInputError(
                f"dtype must be one of {DTYPES}, got {self.dtype!r}", param="dtype"
            )
        for name in (
            "max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size", "cpu_threads",
            "max_image_pixels",
        ):  # fmt: skip
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidInputError(f"{name} must be >= 1", param=name)
        if self.tokenizer_processes is not None and (
            not isinstance(self.tokenizer_processes, int)
            or isinstance(self.tokenizer_processes, bool)
            or self.tokenizer_processes < 0
        ):
            raise InvalidInputError(
                "tokenizer_processes must be an integer >= 0 (0: tokenise in this process)",
                param="tokenizer_processes",
            )
        if not 0 <= self.switch_interval_ms <= 1000:
            raise InvalidInputError(
                "switch_interval_ms must be between 0 and 1000", param="switch_interval_ms"
            )
        check_long_inputs(self.long_inputs)
        if self.pipeline_parallel_size < 1:
            raise InvalidInputError(
                "pipeline_parallel_size must be >= 1", param="pipeline_parallel_size"
            )
        for name in ("data_parallel_size", "replicas_per_gpu"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidInputError(f"{name} must be an integer >= 1", param=name)
        if self.replicas_per_gpu > self.data_parallel_size:
            raise InvalidInputError(
                f"replicas_per_gpu={self.replicas_per_gpu} is more than the "
                f"data_parallel_size={self.data_parallel_size} replicas there are (--dp)",
                param="replicas_per_gpu",
            )
        if not 0.0 < self.gpu_memory_share <= 1.0:
            raise InvalidInputError("gpu_memory_share must be in (0, 1]", param="gpu_memory_share")
        if self.pp_partition is not None:
            if len(self.pp_partition) != self.pipeline_parallel_size:
                raise InvalidInputError(
                    f"pp_partition has {len(self.pp_partition)} entries for "
                    f"pipeline_parallel_size={self.pipeline_parallel_size}",
                    param="pp_partition",
                )
            if min(self.pp_partition) < 1:
                raise InvalidInputError(
                    "every stage needs at least one layer", param="pp_partition"
                )
        if self.pipeline_backend not in ("mp", "inproc"):
            raise InvalidInputError(
                "pipeline_backend must be 'mp' or 'inproc'", param="pipeline_backend"
            )
        if self.pooling is not None and self.pooling not in VECTOR_POOLINGS:
            raise InvalidInputError(
                f"pooling must be one of {', '.join(VECTOR_POOLINGS)}; got {self.pooling!r}",
                param="pooling",
            )
        if self.tower not in TOWERS:
            raise InvalidInputError(
                f"tower must be one of {', '.join(TOWERS)}; got {self.tower!r}", param="tower"
            )
        if self.reranker not in RERANKERS:
            raise InvalidInputError(
                f"reranker must be one of {', '.join(RERANKERS)}; got {self.reranker!r}",
                param="reranker",
            )
        if self.attention not in ATTENTION:
            raise InvalidInputError(
                f"attention must be one of {', '.join(ATTENTION)}; got {self.attention!r}",
                param="attention",
            )
        if self.step_timeout_s is not None and self.step_timeout_s < 0:
            raise InvalidInputError("step_timeout_s must be >= 0", param="step_timeout_s")
        if self.stage_restarts < 0:
            raise InvalidInputError("stage_restarts must be >= 0", param="stage_restarts")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise InvalidInputError("kv_cache_tokens must be >= 1", param="kv_cache_tokens")

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)


def check_long_inputs(policy: str) -> str:
    if policy not in LONG_INPUTS:
        raise InvalidInputError(
            f"long_inputs must be one of {', '.join(LONG_INPUTS)}; got {policy!r}",
            param="long_inputs",
        )
    return policy


def split_layers(
    num_layers: int, num_stages: int, partition: tuple[int, ...] | None
) -> list[range]:
    """Contiguous layer ranges, one per stage; with an uneven split the first stages get one
    layer more each."""
    if partition is not None:
        if sum(partition) != num_layers:
            raise InvalidInputError(
                f"pp_partition {','.join(map(str, partition))} sums to {sum(partition)}, "
                f"but the model has {num_layers} layers",
                param="pp_partition",
            )
        sizes = list(partition)
    else:
        if num_stages > num_layers:
            raise InvalidInputError(
                f"pipeline_parallel_size={num_stages} is larger than the model's "
                f"{num_layers} layers",
                param="pipeline_parallel_size",
            )
        base, extra = divmod(num_layers, num_stages)
        sizes = [base + (1 if i < extra else 0) for i in range(num_stages)]
    ranges, start = [], 0
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges
