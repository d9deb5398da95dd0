"""Where one stage sits in the pipeline and what it runs on, as the deployment decides it for
each stage (``Deployment.stage_spec``) and the stage's runner reads it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.classifier_head import ClassifierHead
from .retrieval import RetrievalHead


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
    compile: bool  # torch.compile the layer bodies
    graph_max_tokens: int  # largest step replayed as CUDA graphs (CUDA only); 0: none
    # Compile while serving eagerly, not before the stage is ready (background_compile.py).
    compile_in_background: bool = False
    classifier: ClassifierHead | None = None  # a classifier's head, run by the last stage
    retrieval: RetrievalHead | None = None  # sparse / multi-vector heads, run by the last stage
    attn_kernel: str = "portable"  # chosen once, in the deployment
    fused_kernels: bool = False  # the deployment's choice; the stage verifies them on its device
    causal: bool = False  # the checkpoint's attention, decided once (models/checkpoint_math.py)
    # Linear layers as dynamic int8 GEMMs (EngineConfig.dtype "int8"; CPU encoders), quantized
    # once at load; ``dtype`` (float32) is then everything else's.
    int8_linears: bool = False

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1
