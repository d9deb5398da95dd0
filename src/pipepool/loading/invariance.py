"""Whether a deployment can honour ``batch_invariant``, decided once at load.

Batch invariance holds only where every operation of the forward has an invariant form
(layers/invariant_ops.py, layers/invariant_attention.py): anything else is refused here by
name, before any process starts, never run and left to vary.
"""

from __future__ import annotations

from ..config import EngineConfig
from ..errors import InvalidInputError
from ..layers import triton_attention
from ..models import Family
from ..models.bert import EncoderStage
from ..models.decoder import DecoderStage

# The stage classes whose every product goes through F.linear / matmul and every attention
# through ``attend`` (their relatives add position biases, windows or kernels of their own).
_INVARIANT_STAGES = (EncoderStage, DecoderStage)
_OPTION = "batch_invariant"


def check_batch_invariant(
    config: EngineConfig,
    family: Family,
    device_kind: str,
    attn_kernel: str,
    retrieval_head: str | None = None,
) -> None:
    """Raise ``InvalidInputError(param="batch_invariant")`` where this deployment cannot
    compute batch-invariant vectors; nothing when the option is off. ``retrieval_head``: the
    name of the model's sparse or multi-vector head, if it has one."""
    if not config.batch_invariant:
        return
    if retrieval_head is not None:
        raise InvalidInputError(
            f"batch_invariant covers dense embeddings and classifier scores; this model's "
            f"{retrieval_head} head pools vocabulary or token rows by scatter-adds whose order "
            "is not fixed",
            param=_OPTION,
        )
    if family.stage not in _INVARIANT_STAGES:
        raise InvalidInputError(
            f"batch_invariant is not available for the {family.name} family: its layers have "
            "no batch-invariant form (BERT-style encoders and Qwen/Llama/Mistral-style decoders "
            "do)",
            param=_OPTION,
        )
    if config.dtype == "int8":
        raise InvalidInputError(
            "batch_invariant cannot run with dtype int8: dynamic int8 scales each step's "
            "activations by the step's own maximum",
            param=_OPTION,
        )
    if config.compile:
        raise InvalidInputError(
            "batch_invariant runs the layers eagerly (torch.compile picks kernels by shape); "
            "compile cannot be set with it",
            param=_OPTION,
        )
    if device_kind == "cuda" and attn_kernel != "triton":
        raise InvalidInputError(
            "batch_invariant on CUDA needs the Triton attention kernel (Triton installed, "
            f"fp16/bf16, head size one of {sorted(triton_attention.TILES)}); this deployment "
            f"would use {attn_kernel!r}",
            param=_OPTION,
        )
