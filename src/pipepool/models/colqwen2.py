"""ColQwen2 (transformers' ``ColQwen2ForRetrieval``): Qwen2-VL's decoder and vision tower, every
token's final state projected by ``embedding_proj_layer`` (one vector per token, normalised
per token by the pooler), scored by MaxSim.

transformers runs its language model on input embeddings without ids, so its positions are
1-D (each token's index, on all three M-RoPE axes) for page images too, not
``get_rope_index``'s: the inputs carry those positions (``intake/vlm_inputs.py``), and the
stages apply them as any media rows (``qwen2_vl.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..core.classifier_head import ClassifierHead
from ..errors import ModelLoadError
from .base import StepInputs, WeightSpec, linear_specs
from .qwen2_vl import Qwen2VLConfig, Qwen2VLStage


@dataclass(frozen=True)
class ColQwen2Config:
    """A ColQwen2 config.json: its Qwen2-VL (``vlm_config``) and the projection's width."""

    vl: Qwen2VLConfig
    embedding_dim: int

    @classmethod
    def from_hf(cls, hf: dict, family: str, *, causal: bool = True) -> ColQwen2Config:
        vlm = hf.get("vlm_config")
        if not isinstance(vlm, dict) or vlm.get("model_type", "qwen2_vl") != "qwen2_vl":
            raise ModelLoadError(
                "ColQwen2: vlm_config must be a Qwen2-VL config (model_type qwen2_vl); got "
                f"{vlm.get('model_type') if isinstance(vlm, dict) else vlm!r}"
            )
        return cls(Qwen2VLConfig.from_hf(vlm, "qwen2_vl", causal=causal),
                   int(hf.get("embedding_dim", 128)))  # fmt: skip


class ColQwen2Stage(Qwen2VLStage):
    """A slice of ColQwen2; the last stage projects every row to ``embedding_dim``."""

    fixed_pooling = True  # one vector per token, as the checkpoint scores them

    def __init__(
        self,
        cfg: ColQwen2Config,
        layers: range,
        first: bool,
        last: bool,
        max_len: int,
        head: ClassifierHead | None = None,
    ) -> None:
        super().__init__(cfg.vl, layers, first, last, max_len, head)
        self.embedding_dim = cfg.embedding_dim
        self.keeps_rows = False  # every token is an output
        self.projection = nn.Linear(cfg.vl.text.hidden_size, cfg.embedding_dim) if last else None

    @property
    def output_size(self) -> int:
        return self.embedding_dim

    def forward(self, x: torch.Tensor, inputs: StepInputs, kv_caches) -> torch.Tensor:
        x = super().forward(x, inputs, kv_caches)
        return self.projection(x) if self.projection is not None else x

    def weight_specs(self) -> list[WeightSpec]:
        specs = super().weight_specs()
        if self.projection is not None:
            h = self.vl.text.hidden_size
            specs += linear_specs("embedding_proj_layer", "projection", self.embedding_dim, h, True)
        return specs
