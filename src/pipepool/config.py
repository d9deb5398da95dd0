"""Engine configuration: what the user asked for, checked once, before any process starts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import InvalidInputError

POOLING_TYPES = ("last", "mean", "cls", "all")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# Test-only fault injections; none is reachable from a user flag except the hidden parity one.
FAULTS = ("skip_post_step_on_non_last_stage", "raise_on_stage")


@dataclass(frozen=True)
class EngineConfig:
    """Options shared by every front end (API, CLI, server). Frozen: one engine, one config."""

    model: str | None = None  # local folder or hub id; None = the bundled all-MiniLM-L6-v2
    dtype: str = "auto"  # auto: fp32 on CPU, the checkpoint's 16-bit type on GPU
    device: str = "auto"  # auto: cuda when available, else cpu
    max_num_batched_tokens: int = 16384  # token budget of one step (TEI's default)
    max_num_seqs: int = 256  # requests in one step
    max_model_len: int | None = (
        None  # None: from the model (sentence-transformers max_seq_length first)
    )
    pipeline_parallel_size: int = 1
    pp_partition: tuple[int, ...] | None = (
        None  # layers per stage, e.g. (10, 18); sums to num_layers
    )
    # How stages run when pipeline_parallel_size > 1: "mp", one process per stage (the real
    # thing); "inproc", all stages in this process, one after the other (tests, debugging).
    pipeline_backend: str = "mp"
    pooling: str | None = None  # override the model's pooling: last | mean | cls
    normalize: bool | None = None  # override the model's default L2 normalisation
    block_size: int = 16  # tokens per KV-cache block
    kv_cache_tokens: int | None = None  # KV capacity in tokens; None: sized from memory
    # Expected-state checks of DESIGN.md §1 (mirror vs plan, digests between stages).
    verify_state: bool = True
    # torch.compile of the layer bodies; None: on for CUDA, off on CPU.
    compile: bool | None = None
    # Multi-process pipeline runs ahead of the devices: one plan more in flight than stages,
    # and the last stage sends step k's results only once step k+1 is queued on its device,
    # so no device waits for the host between steps. None: on for CUDA. Off on CPU, where
    # a step computes synchronously and running ahead would only hold results back.
    overlap_steps: bool | None = None
    inject_fault: str | None = None  # test-only; one of FAULTS
    fault_stage: int = 0  # the stage that "raise_on_stage" makes fail
    fault_step: int = 0  # the step at which "raise_on_stage" fires

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidInputError(
                f"dtype must be one of {DTYPES}, got {self.dtype!r}", param="dtype"
            )
        if self.max_num_batched_tokens < 1:
            raise InvalidInputError(
                "max_num_batched_tokens must be >= 1", param="max_num_batched_tokens"
            )
        if self.max_num_seqs < 1:
            raise InvalidInputError("max_num_seqs must be >= 1", param="max_num_seqs")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise InvalidInputError("max_model_len must be >= 1", param="max_model_len")
        if self.pipeline_parallel_size < 1:
            raise InvalidInputError(
                "pipeline_parallel_size must be >= 1", param="pipeline_parallel_size"
            )
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
        if self.pooling is not None and self.pooling not in POOLING_TYPES[:3]:
            raise InvalidInputError(
                f"pooling must be one of last, mean, cls; got {self.pooling!r}", param="pooling"
            )
        if self.block_size < 1:
            raise InvalidInputError("block_size must be >= 1", param="block_size")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise InvalidInputError("kv_cache_tokens must be >= 1", param="kv_cache_tokens")
        if self.inject_fault is not None and self.inject_fault not in FAULTS:
            raise InvalidInputError(f"unknown fault {self.inject_fault!r}", param="inject_fault")

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)


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
