"""ModernBERT (gte-modernbert-base, modernbert-embed-base, gte-reranker-modernbert-base), as
transformers' ``modeling_modernbert.py`` computes it.

Token embeddings + LayerNorm, then pre-norm layers (the first layer has no attention norm):
x += Wo(attention(norm(x))); x += Wo(act(input) * gate) with input | gate = Wi(norm(x)); a final
LayerNorm. Attention is bidirectional with RoPE from each prompt's position 0; every
``global_attn_every_n_layers``-th layer (from layer 0) attends over the whole prompt with
``global_rope_theta``, the others over a symmetric window of ``local_attention // 2`` tokens on
either side with ``local_rope_theta`` (``layers/windowed_attention.py``). Biases on the
attention, MLP and norms each follow their config switch.

Like every encoder, a prompt is never chunked and no KV cache is kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..core.classifier_head import ClassifierHead
from ..errors import ModelLoadError
from ..layers.activation import ACTIVATIONS, get_activation
from ..layers.attention import AttentionShape, attend
from ..layers.cpu_tiles import plan_tiles
from ..layers.rotary import RotaryEmbedding, apply_rotary
from ..layers.windowed_attention import windowed_attention
from .base import StageModel, StepInputs, WeightSpec, embedding, linear_specs
from .between_layers import between_layers
from .score_heads import ModernBertClassifier

_LAYER_TYPES = ("full_attention", "sliding_attention")
# transformers' ModernBertConfig defaults where a config leaves a field out.
_DEFAULT_THETA = {"full_attention": 160_000.0, "sliding_attention": 10_000.0}
_LEGACY_THETA = {"full_attention": "global_rope_theta", "sliding_attention": "local_rope_theta"}


@dataclass(frozen=True)
class ModernBertConfig:
    """The ModernBERT shape and math a checkpoint's config.json asks for, read and checked
    once (``from_hf``); every stage of one deployment builds from the same one."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_positions: int
    norm_eps: float
    norm_bias: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    global_layers: tuple[bool, ...]  # per layer: whole-prompt attention, else the window
    half_window: int  # a local layer's query sees keys up to this many positions away
    global_theta: float
    local_theta: float
    classifier_pooling: str  # the row a *ForSequenceClassification head reads: cls | mean
    classifier_act: str
    classifier_bias: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, hf: dict, family: str = "modernbert", *, causal: bool = False):
        """The config transformers 5.17 reads: ``layer_types`` and ``rope_parameters`` where
        present, else the older ``global_attn_every_n_layers`` and ``*_rope_theta``."""
        assert not causal, "ModernBERT is an encoder"
        hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        num_layers = int(hf["num_hidden_layers"])
        if hf.get("head_dim") not in (None, hidden // heads):
            _refuse("head_dim", hf["head_dim"], "a rotary size other than hidden / heads")
        for name in ("hidden_activation", "classifier_activation"):
            if hf.get(name, "gelu") not in ACTIVATIONS:  # fail at load time, not mid-request
                _refuse(name, hf[name], "an activation pipepool does not have")
        theta = {t: _rope_theta(hf, t) for t in _LAYER_TYPES}
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            max_positions=int(hf.get("max_position_embeddings", 8192)),
            norm_eps=float(hf.get("norm_eps", 1e-5)),
            norm_bias=bool(hf.get("norm_bias", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            hidden_act=hf.get("hidden_activation", "gelu"),
            global_layers=_global_layers(hf, num_layers),
            half_window=_half_window(hf),
            global_theta=theta["full_attention"],
            local_theta=theta["sliding_attention"],
            classifier_pooling=hf.get("classifier_pooling", "cls"),
            classifier_act=hf.get("classifier_activation", "gelu"),
            classifier_bias=bool(hf.get("classifier_bias", False)),
        )


def _refuse(field: str, value, what: str) -> None:
    raise ModelLoadError(
        f"config.json sets {field}={value!r} ({what}), which the modernbert family in pipepool "
        "does not implement; refusing rather than computing other math"
    )


def _global_layers(hf: dict, num_layers: int) -> tuple[bool, ...]:
    types = hf.get("layer_types")
    if types is None:  # the older configs: layer 0 global, then every n-th
        every = hf.get("global_attn_every_n_layers", 3)
        if not isinstance(every, int) or every < 1:
            _refuse("global_attn_every_n_layers", every, "not a positive layer count")
        types = ["sliding_attention" if i % every else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers or any(t not in _LAYER_TYPES for t in types):
        _refuse("layer_types", types, f"one of {_LAYER_TYPES} for each of {num_layers} layers")
    return tuple(t == "full_attention" for t in types)


def _half_window(hf: dict) -> int:
    # transformers' ``sliding_window`` property is ``local_attention // 2``; a config that sets
    # sliding_window sets local_attention to twice it.
    if "sliding_window" in hf:
        half = hf["sliding_window"]
        if not isinstance(half, int) or half < 0:
            _refuse("sliding_window", half, "not a window size")
        return half
    local = hf.get("local_attention", 128)
    if not isinstance(local, int) or local < 0:
        _refuse("local_attention", local, "not a window size")
    return local // 2


def _rope_theta(hf: dict, layer_type: str) -> float:
    """The base of a layer type's RoPE; only the default rope_type exists here (the config's
    field table refuses any other)."""
    params = (hf.get("rope_parameters") or {}).get(layer_type) or {}
    if "rope_theta" in params:
        theta = params["rope_theta"]
    else:
        legacy = _LEGACY_THETA[layer_type]
        theta = hf.get(legacy, _DEFAULT_THETA[layer_type])
        if theta is None:  # transformers 5.17 has no fallback for it either
            _refuse(legacy, theta, "a RoPE base")
    if not isinstance(theta, (int, float)) or theta <= 0:
        _refuse(f"rope_parameters.{layer_type}.rope_theta", theta, "a RoPE base")
    return float(theta)


def _layer_norm(cfg: ModernBertConfig) -> nn.LayerNorm:
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)


class ModernBertLayer(nn.Module):
    """Pre-norm block: x += Wo(attn(attn_norm(x))); x += mlp_out(act(in) * gate), with
    in | gate = mlp_in(mlp_norm(x)). Layer 0 has no attn_norm (transformers' Identity)."""

    def __init__(self, cfg: ModernBertConfig, index: int) -> None:
        super().__init__()
        self.cfg, h = cfg, cfg.hidden_size
        self.is_global = cfg.global_layers[index]
        self.scale = cfg.head_dim**-0.5
        self.attn_norm = _layer_norm(cfg) if index > 0 else None
        self.qkv = nn.Linear(h, 3 * h, bias=cfg.attention_bias)
        self.attn_out = nn.Linear(h, h, bias=cfg.attention_bias)
        self.mlp_norm = _layer_norm(cfg)
        self.mlp_in = nn.Linear(h, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.mlp_out = nn.Linear(cfg.intermediate_size, h, bias=cfg.mlp_bias)
        self.act = get_activation(cfg.hidden_act)

    def forward(
        self, x: torch.Tensor, inputs: StepInputs, rope: RotaryEmbedding, kernel: str
    ) -> torch.Tensor:
        cfg = self.cfg
        a = self.attn_norm(x) if self.attn_norm is not None else x
        # Wqkv's rows are q | k | v, each heads x head_dim.
        q, k, v = self.qkv(a).view(-1, 3, cfg.num_heads, cfg.head_dim).unbind(1)
        # RoPE in fp32 and back, as transformers rotates.
        q, k = apply_rotary(inputs.positions, q.float(), k.float(), rope.cos_sin, cfg.head_dim)
        q, k = q.to(v.dtype), k.to(v.dtype)
        if self.is_global:
            out = attend(q, k, v, inputs.attn, None, scale=self.scale, kernel=kernel)
        else:
            out = windowed_attention(
                q, k, v, inputs.attn, scale=self.scale, half_window=cfg.half_window, kernel=kernel
            )
        x = x + self.attn_out(out.flatten(1))  # out: [T, H, D]
        gate_in, gate = self.mlp_in(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.mlp_out(self.act(gate_in) * gate)


class ModernBertStage(StageModel):
    """A slice of ModernBERT's layers; the first stage embeds, the last applies final_norm and
    carries a ``*ForSequenceClassification`` head. Returns hidden states [T, hidden]."""

    causal = False
    kv_layout = None
    graph_safe = False  # its local layers attend outside attend(): only Triton's are captured

    def graph_safe_with(self, kernel: str) -> bool:
        return kernel == "triton"

    def __init__(
        self,
        cfg: ModernBertConfig,
        layers: range,
        first: bool,
        last: bool,
        max_len: int,
        head: ClassifierHead | None = None,
    ) -> None:
        super().__init__(layers, first, last)
        self.cfg = cfg
        self.hidden_size, self.num_layers = cfg.hidden_size, cfg.num_layers
        self.max_positions = cfg.max_positions
        windowed = not all(cfg.global_layers[i] for i in layers)
        self.attention_shape = AttentionShape(cfg.head_dim, 1, causal=False, windowed=windowed)
        self.attn_kernel = "portable"
        h = cfg.hidden_size
        if first:
            self.tok_embeddings = embedding(cfg.vocab_size, h)
            self.emb_norm = _layer_norm(cfg)
        self.layers = nn.ModuleDict({str(i): ModernBertLayer(cfg, i) for i in layers})
        table = max(max_len, 1)
        d = cfg.head_dim
        self.rope_global = RotaryEmbedding(d, d, cfg.global_theta, None, table)
        self.rope_local = RotaryEmbedding(d, d, cfg.local_theta, None, table)
        if last:
            self.final_norm = _layer_norm(cfg)
        if last and head is not None:
            self.score_head = ModernBertClassifier(
                h, head.num_labels, activation=cfg.classifier_act, eps=cfg.norm_eps,
                dense_bias=cfg.classifier_bias, norm_bias=cfg.norm_bias,
            )  # fmt: skip

    @classmethod
    def honours_key_lengths(cls, cfg: Any) -> bool:
        return True  # global layers through attend(), local ones through windowed_attention

    def reset_buffers(self) -> None:
        self.rope_global.reset_table()
        self.rope_local.reset_table()

    def forward(self, x: torch.Tensor, inputs: StepInputs, kv_caches=None) -> torch.Tensor:
        if x.device.type != "cpu" or len(inputs.attn.cu_q_host) <= 2:
            return self._forward_rows(x, inputs)
        # CPU: cache-sized tiles of length-sorted requests (layers/cpu_tiles.py), as BERT.
        out = x.new_empty((x.shape[0], self.hidden_size), dtype=next(self.parameters()).dtype)
        for tile in plan_tiles(inputs.attn.cu_q_host, key_lens=inputs.attn.key_lens):
            tile_inputs = StepInputs(inputs.positions.index_select(0, tile.rows), tile.meta)
            y = self._forward_rows(x.index_select(0, tile.rows), tile_inputs)
            out.index_copy_(0, tile.rows, y)
        return out

    def _forward_rows(self, x: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        if self.is_first:
            x = self.emb_norm(F.embedding(x, self.tok_embeddings.weight))
        for layer in self.layers.values():
            between_layers()
            rope = self.rope_global if layer.is_global else self.rope_local
            x = layer(x, inputs, rope, self.attn_kernel)
        return self.final_norm(x) if self.is_last else x

    def weight_specs(self) -> list[WeightSpec]:
        cfg, h = self.cfg, self.cfg.hidden_size
        specs: list[WeightSpec] = []
        if self.is_first:
            vocab = (cfg.vocab_size, h)
            specs.append(
                WeightSpec("embeddings.tok_embeddings.weight", vocab, "tok_embeddings.weight")
            )
            specs += _norm_specs(cfg, "embeddings.norm", "emb_norm")
        for i in self.layer_range:
            c, p = f"layers.{i}", f"layers.{i}"
            if i > 0:
                specs += _norm_specs(cfg, f"{c}.attn_norm", f"{p}.attn_norm")
            bias = cfg.attention_bias
            specs += linear_specs(f"{c}.attn.Wqkv", f"{p}.qkv", 3 * h, h, bias)
            specs += linear_specs(f"{c}.attn.Wo", f"{p}.attn_out", h, h, bias)
            specs += _norm_specs(cfg, f"{c}.mlp_norm", f"{p}.mlp_norm")
            inter, bias = cfg.intermediate_size, cfg.mlp_bias
            specs += linear_specs(f"{c}.mlp.Wi", f"{p}.mlp_in", 2 * inter, h, bias)
            specs += linear_specs(f"{c}.mlp.Wo", f"{p}.mlp_out", h, inter, bias)
        if self.is_last:
            specs += _norm_specs(cfg, "final_norm", "final_norm")
        return specs + self.head_specs()


def _norm_specs(cfg: ModernBertConfig, ckpt: str, param: str) -> list[WeightSpec]:
    h = cfg.hidden_size
    specs = [WeightSpec(f"{ckpt}.weight", (h,), f"{param}.weight")]
    if cfg.norm_bias:
        specs.append(WeightSpec(f"{ckpt}.bias", (h,), f"{param}.bias"))
    return specs
