"""The T5 encoder (sentence-t5, gtr-t5): ``T5EncoderModel``, or the encoder of a ``T5Model`` /
``T5ForConditionalGeneration`` checkpoint, as transformers' modeling_t5.py computes it.

Pre-norm blocks with T5's RMS norm (no mean, no bias), attention without the 1/sqrt(d) scale
plus a relative position bias that layer 0's table defines and every layer reuses, a ReLU or
gated-GELU feed-forward, no biases anywhere, and a final norm. There is no position table:
positions enter only through the bias (layers/relative_attention.py), which every stage computes
from its own copy of the table."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..core.classifier_head import ClassifierHead
from ..errors import ModelLoadError
from ..layers.activation import get_activation
from ..layers.attention import AttentionShape
from ..layers.norm import rms_norm
from ..layers.relative_attention import BiasedAttentionPlan, RelativePositionBias, biased_attention
from .base import StageModel, StepInputs, WeightSpec, embedding

# (is_gated_act, dense_act_fn) -> feed_forward_proj: the feed-forwards implemented here.
_FEED_FORWARDS = {(False, "relu"): "relu", (True, "gelu_new"): "gated-gelu"}


@dataclass(frozen=True)
class T5Config:
    """The T5 encoder shape and math a checkpoint's config.json asks for (gated or not,
    relative-bias buckets, norm eps), read and checked once; every stage builds from it."""

    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_layers: int
    num_heads: int
    num_buckets: int  # relative_attention_num_buckets
    max_distance: int  # relative_attention_max_distance
    eps: float
    gated: bool  # act(wi_0 x) * wi_1 x, else act(wi x)
    activation: str  # dense_act_fn
    max_positions: int

    @classmethod
    def from_hf(cls, hf: dict, family: str, *, causal: bool = False) -> T5Config:
        """transformers' T5Config defaults where a field is absent. ``dense_act_fn`` and
        ``is_gated_act``, when config.json carries them, win over what ``feed_forward_proj``
        implies (T5Config sets them from it, then from the saved fields)."""
        assert not causal
        proj = hf.get("feed_forward_proj", "relu")
        parts = proj.split("-")
        derived = (parts[0] == "gated", "gelu_new" if proj == "gated-gelu" else parts[-1])
        gated = bool(hf.get("is_gated_act", derived[0]))
        activation = hf.get("dense_act_fn", derived[1])
        if (gated, activation) not in _FEED_FORWARDS:
            raise ModelLoadError(
                f"config.json asks for a {'gated ' if gated else ''}{activation} feed-forward "
                f"(feed_forward_proj={proj!r}, dense_act_fn={activation!r}, is_gated_act={gated}"
                f"), which the {family} family in pipepool does not implement "
                f"({' and '.join(_FEED_FORWARDS.values())} are)"
            )
        get_activation(activation)
        return cls(
            vocab_size=int(hf.get("vocab_size", 32128)),
            d_model=int(hf.get("d_model", 512)),
            d_kv=int(hf.get("d_kv", 64)),
            d_ff=int(hf.get("d_ff", 2048)),
            num_layers=int(hf.get("num_layers", 6)),
            num_heads=int(hf.get("num_heads", 8)),
            num_buckets=int(hf.get("relative_attention_num_buckets", 32)),
            max_distance=int(hf.get("relative_attention_max_distance", 128)),
            eps=float(hf.get("layer_norm_epsilon", 1e-6)),
            gated=gated,
            activation=activation,
            # No position table sets a limit: the length T5 checkpoints were trained for.
            max_positions=int(hf.get("n_positions") or 512),
        )


def t5_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """T5LayerNorm: RMS in fp32, scaled, in the weight's dtype (the next projection's input)."""
    return rms_norm(x, weight, eps).to(weight.dtype)


class T5Layer(nn.Module):
    """Pre-norm block: x += o(attn(norm(x))); x += ff(norm(x)). q|k|v (and wi_0|wi_1) fused."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.cfg = cfg
        inner = cfg.num_heads * cfg.d_kv
        self.attn_norm = nn.Parameter(torch.empty(cfg.d_model))
        self.qkv = nn.Linear(cfg.d_model, 3 * inner, bias=False)
        self.o = nn.Linear(inner, cfg.d_model, bias=False)
        self.ff_norm = nn.Parameter(torch.empty(cfg.d_model))
        self.wi = nn.Linear(cfg.d_model, (2 if cfg.gated else 1) * cfg.d_ff, bias=False)
        self.wo = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)
        self.act = get_activation(cfg.activation)

    def forward(self, x: torch.Tensor, plan: BiasedAttentionPlan) -> torch.Tensor:
        """x: [T, d_model] fp32 residual stream -> the same after this block."""
        cfg = self.cfg
        qkv = self.qkv(t5_norm(x, self.attn_norm, cfg.eps))  # [T, 3 * heads * d_kv]
        x = x + self.o(biased_attention(qkv, plan, cfg.num_heads, cfg.d_kv))
        h = self.wi(t5_norm(x, self.ff_norm, cfg.eps))
        if cfg.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return x + self.wo(h)


class T5EncoderStage(StageModel):
    """A slice of the T5 encoder's blocks. The first stage embeds (``shared``), the last applies
    ``final_layer_norm``; every stage holds the relative position bias table. Inside a stage
    the residual stream is fp32: transformers keeps ``wo`` in fp32 at half precision, which
    makes its residual fp32 from the first feed-forward on. Hidden states leave a stage in the
    model's dtype."""

    causal = False
    kv_layout = None
    graph_safe = False  # its biased attention runs outside attend()

    def __init__(
        self,
        cfg: T5Config,
        layers: range,
        first: bool,
        last: bool,
        max_len: int,
        head: ClassifierHead | None = None,
    ) -> None:
        super().__init__(layers, first, last)
        if head is not None:
            raise ModelLoadError("the t5 family has no classifier head in pipepool")
        self.cfg = cfg
        self.hidden_size, self.num_layers = cfg.d_model, cfg.num_layers
        self.max_positions = cfg.max_positions
        self.attention_shape = AttentionShape(cfg.d_kv, 1, causal=False, windowed=False)
        self.attn_kernel = "portable"  # unused: the bias needs layers/relative_attention.py
        if first:
            self.shared = embedding(cfg.vocab_size, cfg.d_model)
        self.relative_attention_bias = RelativePositionBias(
            cfg.num_buckets, cfg.max_distance, cfg.num_heads
        )
        self.layers = nn.ModuleDict({str(i): T5Layer(cfg) for i in layers})
        if last:
            self.final_norm = nn.Parameter(torch.empty(cfg.d_model))

    def reset_buffers(self) -> None:
        self.relative_attention_bias.reset_buffers()

    def attention_block_rows(self) -> int | None:
        return None  # no Triton work list: this attention never runs that kernel

    def forward(self, x: torch.Tensor, inputs: StepInputs, kv_caches=None) -> torch.Tensor:
        meta = inputs.attn
        if meta.graph_split is not None:
            # A piecewise CUDA graph replays attention through attend(), which has no bias
            # input; failing the capture makes the runner step eagerly.
            raise RuntimeError("T5's biased attention cannot be captured as CUDA graph pieces")
        assert meta.prefix_slots is None, "an encoder step continues no earlier chunk"
        # The CPU's steps come sorted by length: equal lengths attend as views, unpadded.
        exact = x.device.type == "cpu"
        plan = BiasedAttentionPlan.build(meta.cu_q_host, self.relative_attention_bias, exact=exact)
        dtype = self.relative_attention_bias.weight.dtype
        if self.is_first:
            x = F.embedding(x, self.shared.weight)
        x = x.float()  # [T, d_model]
        for layer in self.layers.values():
            x = layer(x, plan)
        if self.is_last:
            return t5_norm(x, self.final_norm, self.cfg.eps)
        return x.to(dtype)

    def weight_specs(self) -> list[WeightSpec]:
        cfg, d = self.cfg, self.cfg.d_model
        inner = cfg.num_heads * cfg.d_kv
        specs = [
            WeightSpec(
                "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                (cfg.num_buckets, cfg.num_heads),
                "relative_attention_bias.weight",
            )
        ]
        if self.is_first:
            specs.append(WeightSpec("shared.weight", (cfg.vocab_size, d), "shared.weight"))
        for i in self.layer_range:
            c, p = f"encoder.block.{i}.layer", f"layers.{i}"
            specs.append(WeightSpec(f"{c}.0.layer_norm.weight", (d,), f"{p}.attn_norm"))
            for j, name in enumerate("qkv"):
                rows = (j * inner, (j + 1) * inner)
                specs.append(
                    WeightSpec(f"{c}.0.SelfAttention.{name}.weight", (inner, d), f"{p}.qkv.weight",
                               rows)
                )  # fmt: skip
            specs.append(WeightSpec(f"{c}.0.SelfAttention.o.weight", (d, inner), f"{p}.o.weight"))
            specs.append(WeightSpec(f"{c}.1.layer_norm.weight", (d,), f"{p}.ff_norm"))
            ff = f"{c}.1.DenseReluDense"
            if cfg.gated:
                for j in range(2):
                    rows = (j * cfg.d_ff, (j + 1) * cfg.d_ff)
                    specs.append(
                        WeightSpec(f"{ff}.wi_{j}.weight", (cfg.d_ff, d), f"{p}.wi.weight", rows)
                    )
            else:
                specs.append(WeightSpec(f"{ff}.wi.weight", (cfg.d_ff, d), f"{p}.wi.weight"))
            specs.append(WeightSpec(f"{ff}.wo.weight", (d, cfg.d_ff), f"{p}.wo.weight"))
        if self.is_last:
            specs.append(WeightSpec("encoder.final_layer_norm.weight", (d,), "final_norm"))
        return specs
