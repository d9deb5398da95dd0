"""Dual encoders' towers: CLIP, SigLIP and SigLIP2, as transformers' ``CLIPModel`` /
``SiglipModel`` / ``Siglip2Model``.

A dual-encoder checkpoint holds two models: a text tower and a vision tower, each a stack of
pre-norm transformer layers (``x += attn(ln1(x)); x += mlp(ln2(x))``) that splits into
pipeline stages like any other model. Each runs in its own pipeline (``EngineConfig.tower``);
this module holds what both towers share, ``tower_vision.py`` the vision tower's embeddings
and pooling head.

Text towers: CLIP's is causal (its prompts chunk across steps and keep a KV cache, as
transformers masks it) and pools its EOS token, which its tokenizer puts last; SigLIP's is
bidirectional and pools its last token (SigLIP2's text tower is SigLIP's). The last stage
applies the final LayerNorm and the projection (CLIP's ``text_projection``, SigLIP's
``text_model.head``) to every row, so a pooled row is the vector ``get_text_features``
returns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..core.classifier_head import ClassifierHead
from ..core.dual_encoders import DUAL_ENCODERS
from ..errors import ModelLoadError
from ..layers.activation import get_activation
from ..layers.attention import AttentionShape, attend
from .base import KVLayout, StageModel, StepInputs, WeightSpec, embedding, linear_specs

# transformers' model_type of each dual-encoder checkpoint kind.
KINDS = tuple(DUAL_ENCODERS.values())
TOWERS = ("text", "vision")


@dataclass(frozen=True)
class TowerConfig:
    """One tower of a CLIP / SigLIP / SigLIP2 config.json (its ``text_config`` or
    ``vision_config``)."""

    kind: str  # clip | siglip | siglip2
    tower: str  # text | vision
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    hidden_act: str
    # text: position table; vision: patches (+1 for CLIP's class token; SigLIP2: the most
    # patches of one image, its position table's size)
    max_positions: int
    projection_dim: int  # 0: no projection (SigLIP's vision tower: its head is the pooler)
    projection_bias: bool
    vocab_size: int = 0  # text
    image_size: int = 0  # vision
    patch_size: int = 0
    num_channels: int = 3
    attention_pooling: bool = False  # SigLIP's vision head (vision_use_head)

    @property
    def naflex(self) -> bool:
        """SigLIP2's vision tower: images at their own aspect ratio, up to ``max_positions``
        patches, its square position table resized to each image's patch grid."""
        return self.kind == "siglip2" and self.tower == "vision"

    @property
    def causal(self) -> bool:
        return self.kind == "clip" and self.tower == "text"

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def patch_values(self) -> int:
        """Pixel values of one patch (channels x patch x patch)."""
        return self.num_channels * self.patch_size**2

    @property
    def class_token(self) -> bool:
        return self.kind == "clip" and self.tower == "vision"

    @property
    def output_size(self) -> int:
        return self.projection_dim or self.hidden_size

    @classmethod
    def from_hf(cls, hf: dict, kind: str, tower: str) -> TowerConfig:
        if kind not in KINDS or tower not in TOWERS:
            raise ModelLoadError(f"no {tower} tower of kind {kind!r} ({', '.join(KINDS)})")
        sub = hf.get(f"{tower}_config")
        if not isinstance(sub, dict):
            raise ModelLoadError(f"config.json of a {kind} model has no {tower}_config")
        act = sub.get("hidden_act", "quick_gelu" if kind == "clip" else "gelu_pytorch_tanh")
        if kind == "siglip2" and not isinstance(sub.get("patch_size", 16), int):
            raise ModelLoadError(
                f"{tower}_config.patch_size {sub['patch_size']!r}: only square patches (one "
                "integer) are implemented"
            )
        get_activation(act)  # refuse at load time, not mid-request
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            if not isinstance(sub.get(name), int):
                raise ModelLoadError(f"{tower}_config.{name} is missing or not an integer")
        hidden, heads = sub["hidden_size"], sub["num_attention_heads"]
        if hidden % heads:
            raise ModelLoadError(f"{tower}_config: hidden_size {hidden} is not a multiple of heads")
        fields = dict(
            kind=kind, tower=tower, hidden_size=hidden,
            intermediate_size=sub["intermediate_size"], num_layers=sub["num_hidden_layers"],
            num_heads=heads, layer_norm_eps=float(sub.get("layer_norm_eps", 1e-5 if kind ==
                                                          "clip" else 1e-6)),
            hidden_act=act,
        )  # fmt: skip
        if tower == "text":
            if kind == "clip":
                projection, bias = int(hf.get("projection_dim", 512)), False
            else:  # SigLIP's text head: hidden -> projection_size (hidden by default)
                projection, bias = int(sub.get("projection_size") or hidden), True
            return cls(
                **fields, max_positions=int(sub.get("max_position_embeddings", 77 if kind ==
                                                     "clip" else 64)),
                projection_dim=projection, projection_bias=bias, vocab_size=int(sub["vocab_size"]),
            )  # fmt: skip
        if kind == "siglip2":
            return cls._naflex_vision(sub, fields)
        image, patch = int(sub.get("image_size", 224)), int(sub.get("patch_size", 16))
        if image % patch:
            raise ModelLoadError(f"vision_config: image_size {image} is not a multiple of {patch}")
        use_head = kind == "siglip" and bool(sub.get("vision_use_head", True))
        if kind == "siglip" and not use_head:
            raise ModelLoadError(
                "vision_config.vision_use_head=false: the tower has no pooled output "
                "(transformers' get_image_features returns none); nothing to embed"
            )
        patches = (image // patch) ** 2
        return cls(
            **fields, max_positions=patches + (kind == "clip"),
            projection_dim=int(hf.get("projection_dim", 512)) if kind == "clip" else 0,
            projection_bias=False, image_size=image, patch_size=patch,
            num_channels=int(sub.get("num_channels", 3)), attention_pooling=use_head,
        )  # fmt: skip

    @classmethod
    def _naflex_vision(cls, sub: dict, fields: dict) -> TowerConfig:
        patches = int(sub.get("num_patches", 256))
        side = round(patches**0.5)
        if side * side != patches:
            raise ModelLoadError(
                f"vision_config.num_patches {patches} is not a square: SigLIP2's position table "
                "is a square grid"
            )
        if not bool(sub.get("vision_use_head", True)):
            raise ModelLoadError(
                "vision_config.vision_use_head=false: the tower has no pooled output "
                "(transformers' get_image_features returns none); nothing to embed"
            )
        return cls(
            **fields, max_positions=patches, projection_dim=0, projection_bias=False,
            patch_size=int(sub.get("patch_size", 16)), num_channels=int(sub.get("num_channels", 3)),
            attention_pooling=True,
        )  # fmt: skip


class TowerLayer(nn.Module):
    """Pre-norm block: x += out(attn(ln1(x))); x += fc2(act(fc1(ln2(x))))."""

    def __init__(self, cfg: TowerConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.num_heads, self.head_dim = cfg.num_heads, h // cfg.num_heads
        self.norm1 = nn.LayerNorm(h, eps=eps)
        self.qkv = nn.Linear(h, 3 * h)
        self.out = nn.Linear(h, h)
        self.norm2 = nn.LayerNorm(h, eps=eps)
        self.fc1 = nn.Linear(h, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, h)
        self.act: Callable[[torch.Tensor], torch.Tensor] = get_activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor, inputs: StepInputs, kv_cache, kernel: str) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).view(-1, 3 * self.num_heads, self.head_dim).chunk(3, 1)
        a = attend(q, k, v, inputs.attn, kv_cache, scale=self.head_dim**-0.5, kernel=kernel)
        x = x + self.out(a.flatten(1))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))

    @staticmethod
    def specs(cfg: TowerConfig, ckpt: str, param: str) -> list[WeightSpec]:
        """``ckpt``: the layer's checkpoint prefix (``text_model.encoder.layers.3``)."""
        h, inter = cfg.hidden_size, cfg.intermediate_size
        specs: list[WeightSpec] = []
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
            rows = (j * h, (j + 1) * h)
            specs += linear_specs(f"{ckpt}.self_attn.{name}", f"{param}.qkv", h, h, True, rows)
        specs += linear_specs(f"{ckpt}.self_attn.out_proj", f"{param}.out", h, h, True)
        specs += norm_specs(f"{ckpt}.layer_norm1", f"{param}.norm1", h)
        specs += norm_specs(f"{ckpt}.layer_norm2", f"{param}.norm2", h)
        specs += linear_specs(f"{ckpt}.mlp.fc1", f"{param}.fc1", inter, h, True)
        specs += linear_specs(f"{ckpt}.mlp.fc2", f"{param}.fc2", h, inter, True)
        return specs


def norm_specs(ckpt: str, param: str, dim: int) -> list[WeightSpec]:
    return [
        WeightSpec(f"{ckpt}.weight", (dim,), f"{param}.weight"),
        WeightSpec(f"{ckpt}.bias", (dim,), f"{param}.bias"),
    ]


class TowerStage(StageModel):
    """A slice of one tower's layers. The first stage embeds (``_embed``: tokens here, patches
    in ``tower_vision.VisionStage``), the last applies the tower's final norm and projection to
    every row (``_finish``); the pooler then picks the row the tower pools."""

    graph_safe = False  # vision steps carry patch rows, not token ids (no graph buffers)
    compiles = False  # eager layers (a compiled body is future work)
    fixed_pooling = True

    def __init__(
        self,
        cfg: TowerConfig,
        layers: range,
        first: bool,
        last: bool,
        max_len: int,
        head: ClassifierHead | None = None,
    ) -> None:
        super().__init__(layers, first, last)
        if head is not None:
            raise ModelLoadError(f"a {cfg.kind} {cfg.tower} tower has no classifier head")
        self.cfg = cfg
        self.hidden_size, self.num_layers = cfg.hidden_size, cfg.num_layers
        self.max_positions = cfg.max_positions
        self.causal = cfg.causal
        head_dim = cfg.hidden_size // cfg.num_heads
        self.kv_layout = KVLayout(cfg.num_heads, head_dim) if cfg.causal else None
        self.attention_shape = AttentionShape(head_dim, 1, causal=cfg.causal, windowed=False)
        self.attn_kernel = "portable"
        self.layers = nn.ModuleDict({str(i): TowerLayer(cfg) for i in layers})
        if first:
            self._init_embeddings()
        if last:
            self.final_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
            self.projection = (
                nn.Linear(cfg.hidden_size, cfg.projection_dim, bias=cfg.projection_bias)
                if cfg.projection_dim
                else None
            )

    @property
    def output_size(self) -> int:
        return self.cfg.output_size

    def _init_embeddings(self) -> None:
        self.token_embedding = embedding(self.cfg.vocab_size, self.cfg.hidden_size)
        self.position_embedding = embedding(self.cfg.max_positions, self.cfg.hidden_size)

    def _embed(self, x: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        return self.token_embedding(x) + self.position_embedding(inputs.positions)

    def _finish(self, x: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        x = self.final_norm(x)
        return self.projection(x) if self.projection is not None else x

    @property
    def prefix(self) -> str:
        return f"{self.cfg.tower}_model"

    def forward(self, x: torch.Tensor, inputs: StepInputs, kv_caches=None) -> torch.Tensor:
        if self.is_first:
            x = self._embed(x, inputs)
        for j, layer in enumerate(self.layers.values()):
            kv = kv_caches[j] if kv_caches is not None else None
            x = layer(x, inputs, kv, self.attn_kernel)
        if self.is_last:
            x = self._finish(x, inputs)
        return x

    def weight_specs(self) -> list[WeightSpec]:
        cfg, h, p = self.cfg, self.cfg.hidden_size, self.prefix
        specs = self._embedding_specs() if self.is_first else []
        for i in self.layer_range:
            specs += TowerLayer.specs(cfg, f"{p}.encoder.layers.{i}", f"layers.{i}")
        if self.is_last:
            specs += self._final_specs()
            if self.projection is not None:
                specs += linear_specs(
                    self._projection_name(), "projection", cfg.projection_dim, h,
                    cfg.projection_bias,
                )  # fmt: skip
        return specs

    def _embedding_specs(self) -> list[WeightSpec]:
        cfg, h, p = self.cfg, self.cfg.hidden_size, self.prefix
        return [
            WeightSpec(
                f"{p}.embeddings.token_embedding.weight", (cfg.vocab_size, h),
                "token_embedding.weight",
            ),
            WeightSpec(
                f"{p}.embeddings.position_embedding.weight", (cfg.max_positions, h),
                "position_embedding.weight",
            ),
        ]  # fmt: skip

    def _final_specs(self) -> list[WeightSpec]:
        return norm_specs(f"{self.prefix}.final_layer_norm", "final_norm", self.cfg.hidden_size)

    def _projection_name(self) -> str:
        return "text_projection" if self.cfg.kind == "clip" else "text_model.head"
