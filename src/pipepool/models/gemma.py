"""Gemma decoders: Gemma2 (bge-multilingual-gemma2) and Gemma3 text (EmbeddingGemma,
Gemma3ForCausalLM), computed as transformers 5.17's ``modeling_gemma2.py`` /
``modeling_gemma3.py`` do; and the first Gemma (``modeling_gemma.py``), the decoder of
PaliGemma (``colpali.py``): pre-norms only (``input_layernorm`` before attention,
``post_attention_layernorm`` before the MLP), queries scaled by ``head_dim ** -0.5``, its MLP's
activation in ``hidden_act``.

What sets them apart from the Llama-style decoders (``decoder.py``): embeddings scaled by
sqrt(hidden) rounded to the model's dtype; RMSNorm scaling by ``1 + weight`` in float32 before the
cast back; "sandwich" norms around both attention and MLP; a GeGLU MLP; queries scaled by
``query_pre_attn_scalar ** -0.5``; sliding-window layers by ``layer_types``; Gemma2's attention
logit soft-capping; Gemma3's q/k norms, RoPE base per layer type and, with
``use_bidirectional_attention``, bidirectional layers whose sliding window is symmetric.

Layers whose attention :func:`..layers.attention.attend` computes (causal with or without a
window, bidirectional without one, no soft-capping) go through it and its fast kernels;
bidirectional windowed ones through :func:`..layers.windowed_attention.windowed_attention`
(ModernBERT's: flash on CUDA); soft-capped ones through the Triton kernel where the deployment
chose it (CUDA), else :func:`..layers.softcap_attention.softcap_attend`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..core.classifier_head import ClassifierHead
from ..errors import ModelLoadError
from ..layers import gated_activation, qk_rope
from ..layers.activation import TANH_GELUS, get_activation
from ..layers.attention import AttentionShape, attend
from ..layers.qk_rope import fused_qk_norm_rope
from ..layers.rotary import RotaryEmbedding, apply_rotary
from ..layers.softcap_attention import softcap_attend
from ..layers.windowed_attention import windowed_attention
from .base import (
    KVLayout,
    StageModel,
    StepInputs,
    WeightSpec,
    compile_layer_fn,
    embedding,
    kept_rows,
    linear_specs,
)
from .decoder import AttnWeights, split_heads
from .score_heads import build_score_head

FULL, SLIDING = "full_attention", "sliding_attention"

# The config classes' defaults, which apply where config.json leaves a field out.
_COMMON_DEFAULTS = dict(
    hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
    rms_norm_eps=1e-6, attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096,
)  # fmt: skip
_DEFAULTS = {
    "gemma": dict(
        _COMMON_DEFAULTS, vocab_size=256000, hidden_size=3072, intermediate_size=24576,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=16,
        hidden_act="gelu_pytorch_tanh", max_position_embeddings=8192,
        attn_logit_softcapping=None, layer_types=None,
    ),
    "gemma2": dict(
        _COMMON_DEFAULTS, vocab_size=256000, max_position_embeddings=8192,
        attn_logit_softcapping=50.0,
    ),
    "gemma3": dict(
        _COMMON_DEFAULTS, vocab_size=262208, max_position_embeddings=131072,
        attn_logit_softcapping=None,
    ),
}  # fmt: skip


@dataclass(frozen=True)
class GemmaConfig:
    """What a Gemma2 / Gemma3-text checkpoint's config.json asks for, with transformers'
    defaults filled in and the attention direction the deployment decided."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    activation: str  # hidden_activation: the gate's activation in the GeGLU MLP
    scale: float  # query_pre_attn_scalar ** -0.5
    softcap: float | None  # attn_logit_softcapping (Gemma2): tanh(s / cap) * cap; None: off
    attention_bias: bool  # bias on q/k/v/o
    qk_norm: bool  # Gemma3: (1 + w) RMSNorm over head_dim on q and k, before RoPE
    layer_types: tuple[str, ...]  # FULL or SLIDING, per layer
    rope: dict[str, dict]  # layer type -> RoPE parameters (rope_type, rope_theta, factor...)
    # Per layer: None for no window; causal: the keys a query sees up to itself; bidirectional:
    # a key is visible when it is less than this far away on either side.
    windows: tuple[int | None, ...]
    max_positions: int
    # False: Gemma3 with use_bidirectional_attention; prompts run whole, with no KV cache.
    causal: bool = True
    # Gemma2 / Gemma3: norms after attention and after the MLP too; the first Gemma: none.
    sandwich: bool = True
    # final_logit_softcapping is not here: it caps LM-head logits, which no output computes.

    @classmethod
    def from_hf(cls, hf: dict, family: str, *, causal: bool = True) -> GemmaConfig:
        c = {**_DEFAULTS[family], **hf}
        first = family == "gemma"  # its own attention scale and activation field; no windows
        activation = c["hidden_act" if first else "hidden_activation"]
        get_activation(activation)  # refused at load, not mid-request
        num_layers = int(c["num_hidden_layers"])
        if first:  # transformers' Gemma reads no layer types, windows nor soft-capping
            c.update(layer_types=[FULL] * num_layers, attn_logit_softcapping=None,
                     query_pre_attn_scalar=c["head_dim"])  # fmt: skip
        types = tuple(c.get("layer_types") or _default_layer_types(hf, family, num_layers))
        if len(types) != num_layers or not set(types) <= {FULL, SLIDING}:
            raise ModelLoadError(
                f"{family}: layer_types {list(types)} is not one of {FULL!r} / {SLIDING!r} for "
                f"each of the {num_layers} layers"
            )
        softcap = c["attn_logit_softcapping"]
        return cls(
            vocab_size=int(c["vocab_size"]),
            hidden_size=int(c["hidden_size"]),
            intermediate_size=int(c["intermediate_size"]),
            num_layers=num_layers,
            num_heads=int(c["num_attention_heads"]),
            num_kv_heads=int(c["num_key_value_heads"]),
            head_dim=int(c["head_dim"]),
            rms_norm_eps=float(c["rms_norm_eps"]),
            activation=activation,
            scale=float(c["query_pre_attn_scalar"]) ** -0.5,
            softcap=float(softcap) if softcap is not None else None,
            attention_bias=bool(c["attention_bias"]),
            qk_norm=family == "gemma3",
            layer_types=types,
            rope=_rope_parameters(hf, family),
            windows=_windows(c, family, types, causal),
            max_positions=int(c["max_position_embeddings"]),
            causal=causal,
            sandwich=not first,
        )

    def own_attention(self, layer: int) -> bool:
        """Whether the layer's attention is one ``attend`` does not compute."""
        return self.softcap is not None or (not self.causal and self.windows[layer] is not None)


def _default_layer_types(hf: dict, family: str, num_layers: int) -> list[str]:
    # Gemma2 alternates from a sliding layer; Gemma3 makes every sliding_window_pattern-th full.
    pattern = 2 if family == "gemma2" else int(hf.get("sliding_window_pattern", 6))
    return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]


def _windows(c: dict, family: str, types: tuple[str, ...], causal: bool) -> tuple[int | None, ...]:
    window = c["sliding_window"]
    if SLIDING not in types:
        return (None,) * len(types)
    if window is None:
        raise ModelLoadError(f"{family}: sliding layers without a sliding_window")
    if not causal:
        if family != "gemma3":
            raise ModelLoadError(
                f"{family}: bidirectional attention with sliding layers (sliding_window="
                f"{window}) is not what transformers computes for any config; not implemented"
            )
        # Gemma3TextConfig halves the window of bidirectional checkpoints ("fa exclusive
        # bounds"), and its mask then admits keys at a distance below the result.
        window = int(window) // 2 + 1
    return tuple(int(window) if t == SLIDING else None for t in types)


def _rope_parameters(hf: dict, family: str) -> dict[str, dict]:
    """RoPE parameters per layer type, from the 5.x ``rope_parameters`` or the older top-level
    fields, with the precedence of transformers' config classes."""
    if family in ("gemma", "gemma2"):
        params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
        by_type = {FULL: params, SLIDING: params}
    else:
        nested = hf.get("rope_parameters") or {}
        if not set(nested) <= {FULL, SLIDING}:
            raise ModelLoadError(
                f"gemma3: rope_parameters has {sorted(nested)}; expected one entry per layer "
                f"type ({FULL!r}, {SLIDING!r})"
            )
        nested = {kind: dict(params) if params else None for kind, params in nested.items()}
        full = nested.get(FULL) or {"rope_type": "default"}
        full.update(hf.get("rope_scaling") or {})  # older checkpoints scale global layers only
        full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
        sliding = nested.get(SLIDING) or {"rope_type": "default"}
        sliding.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
        by_type = {FULL: full, SLIDING: sliding}
    for kind, params in by_type.items():
        partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
        if partial not in (None, 1, 1.0):
            raise ModelLoadError(
                f"{family}: partial_rotary_factor={partial!r} ({kind}) is not implemented"
            )
    return by_type


# -- the layer's math, as plain functions (compiled as one graph per piece when asked) ---------


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: normalise and scale by ``1 + weight`` in float32, then cast back (Llama
    casts before scaling, which rounds differently in bf16)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


@functools.cache
def embed_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden) rounded to the model's dtype, as transformers multiplies it (55.4256 is
    55.5 in bf16)."""
    return float(torch.tensor(hidden_size**0.5).to(dtype))


class MlpWeights(NamedTuple):
    """What the block needs after attention."""

    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_attention_norm: torch.Tensor | None  # None: no sandwich norms (the first Gemma)
    pre_feedforward_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    post_feedforward_norm: torch.Tensor | None


def project_qkv(cfg: GemmaConfig, x: torch.Tensor, w: AttnWeights) -> torch.Tensor:
    """input norm -> fused q|k|v projection. x: [T, hidden] -> [T, (Hq + 2 Hkv) * D]."""
    return F.linear(gemma_rms_norm(x, w.norm, cfg.rms_norm_eps), w.qkv, w.qkv_bias)


def qkv_projection(
    cfg: GemmaConfig, x: torch.Tensor, w: AttnWeights
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input norm -> fused q|k|v -> (Gemma3) q/k norms. x: [T, hidden] -> [T, H, D] each."""
    q, k, v = split_heads(cfg, project_qkv(cfg, x, w))
    if w.q_norm is not None and w.k_norm is not None:  # both or neither (Gemma3)
        q = gemma_rms_norm(q, w.q_norm, cfg.rms_norm_eps)
        k = gemma_rms_norm(k, w.k_norm, cfg.rms_norm_eps)
    return q, k, v


def attention_residual_and_gate_up(
    cfg: GemmaConfig, x: torch.Tensor, attn_out: torch.Tensor, w: MlpWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """x += norm(o_proj(attn)) (the first Gemma: no norm); (x, gate|up of norm(x)).
    x: [T, hidden]."""
    eps = cfg.rms_norm_eps
    o = F.linear(attn_out.flatten(1), w.o, w.o_bias)
    x = x + (gemma_rms_norm(o, w.post_attention_norm, eps) if w.post_attention_norm is not None
             else o)  # fmt: skip
    return x, F.linear(gemma_rms_norm(x, w.pre_feedforward_norm, eps), w.gate_up)


def mlp_residual(
    cfg: GemmaConfig, x: torch.Tensor, activated: torch.Tensor, w: MlpWeights
) -> torch.Tensor:
    """x += norm(down(act(gate) * up)) (the first Gemma: no norm), from ``activated`` =
    act(gate) * up."""
    down = F.linear(activated, w.down)
    if w.post_feedforward_norm is None:
        return x + down
    return x + gemma_rms_norm(down, w.post_feedforward_norm, cfg.rms_norm_eps)


def post_attention(
    cfg: GemmaConfig, x: torch.Tensor, attn_out: torch.Tensor, w: MlpWeights
) -> torch.Tensor:
    """x += norm(o_proj(attn)); x += norm(GeGLU(norm(x))). x: [T, hidden]."""
    x, gate_up = attention_residual_and_gate_up(cfg, x, attn_out, w)
    gate, up = gate_up.chunk(2, -1)
    return mlp_residual(cfg, x, get_activation(cfg.activation)(gate) * up, w)


class GemmaOps(NamedTuple):
    """The pieces around attention: plain functions, or torch.compile'd graphs shared by every
    layer (weights are arguments, so layers do not recompile)."""

    qkv: Callable[
        [GemmaConfig, torch.Tensor, AttnWeights], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ] = qkv_projection
    rope: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int],
        tuple[torch.Tensor, torch.Tensor],
    ] = apply_rotary
    post: Callable[[GemmaConfig, torch.Tensor, torch.Tensor, MlpWeights], torch.Tensor] = (
        post_attention
    )
    # The fused q/k-norm + RoPE kernel path starts from here.
    project: Callable[[GemmaConfig, torch.Tensor, AttnWeights], torch.Tensor] = project_qkv
    # The fused GeGLU kernel's path: the parts of ``post`` before and after it.
    mlp_in: Callable[
        [GemmaConfig, torch.Tensor, torch.Tensor, MlpWeights], tuple[torch.Tensor, torch.Tensor]
    ] = attention_residual_and_gate_up
    mlp_out: Callable[[GemmaConfig, torch.Tensor, torch.Tensor, MlpWeights], torch.Tensor] = (
        mlp_residual
    )
    fused_qk_rope: bool = False  # (Gemma3) q/k norms + RoPE in one Triton kernel (CUDA)
    fused_geglu: bool = False  # gelu_tanh(gate) * up in one Triton kernel (CUDA)

    def compiled(self) -> GemmaOps:
        """These ops with every function the eager one torch.compile'd."""
        eager = GemmaOps()
        fns = {f: compile_layer_fn(getattr(eager, f), round_like_eager=True) for f in _FUNCTIONS}
        return self._replace(**fns)


_FUNCTIONS = ("qkv", "rope", "post", "project", "mlp_in", "mlp_out")


class GemmaNorm(nn.Module):
    """Holds an RMSNorm weight of the checkpoint; applies ``gemma_rms_norm``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)


_LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
# The first Gemma's two norms: parameter -> checkpoint name (its pre-MLP norm is named
# post_attention_layernorm, as Llama names it).
_PRE_NORMS = {"input_layernorm": "input_layernorm",
              "pre_feedforward_layernorm": "post_attention_layernorm"}  # fmt: skip


def layer_norm_names(cfg: GemmaConfig) -> dict[str, str]:
    """The layer's norms: parameter name -> checkpoint name."""
    return {n: n for n in _LAYER_NORMS} if cfg.sandwich else _PRE_NORMS


class GemmaLayer(nn.Module):
    """Sandwich-norm block: x += norm(attn(norm(x))); x += norm(mlp(norm(x))) (the first
    Gemma: pre-norms only, x += attn(norm(x)); x += mlp(norm(x))). q|k|v and gate|up are
    fused; ``layer_type`` picks the RoPE table and whether a window applies."""

    # Set by name (layer_norm_names) in __init__; the first Gemma's post_* norms are None.
    input_layernorm: GemmaNorm
    post_attention_layernorm: GemmaNorm | None
    pre_feedforward_layernorm: GemmaNorm
    post_feedforward_layernorm: GemmaNorm | None

    def __init__(self, cfg: GemmaConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.window = cfg, cfg.windows[layer]
        self.layer_type, self.own_attention = cfg.layer_types[layer], cfg.own_attention(layer)
        h, q_dim, kv_dim = (
            cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
        )  # fmt: skip
        norms = layer_norm_names(cfg)
        for name in _LAYER_NORMS:
            setattr(self, name, GemmaNorm(h, cfg.rms_norm_eps) if name in norms else None)
        self.qkv_proj = nn.Linear(h, q_dim + 2 * kv_dim, bias=cfg.attention_bias)
        if cfg.qk_norm:
            self.q_norm = GemmaNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(q_dim, h, bias=cfg.attention_bias)
        self.gate_up_proj = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def attn_weights(self) -> AttnWeights:
        qk = self.cfg.qk_norm
        return AttnWeights(
            self.input_layernorm.weight, self.qkv_proj.weight, self.qkv_proj.bias,
            self.q_norm.weight if qk else None, self.k_norm.weight if qk else None,
        )  # fmt: skip

    def forward(
        self, x, inputs: StepInputs, kv_cache, cos_sin, ops: GemmaOps, kernel: str, keep=None
    ):
        """``keep``: the rows to go on with after attention (``StepInputs.keep_rows``), on
        the last stage's last layer; None: all."""
        cfg, w = self.cfg, self.attn_weights()
        if ops.fused_qk_rope:
            qkv = ops.project(cfg, x, w)
            q, k = fused_qk_norm_rope(
                qkv, inputs.positions, cos_sin, w.q_norm, w.k_norm, num_heads=cfg.num_heads,
                num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps,
                unit_offset=True,
            )  # fmt: skip
            v = split_heads(cfg, qkv)[2]
        else:
            q, k, v = ops.qkv(cfg, x, w)
            q, k = ops.rope(inputs.positions, q, k, cos_sin, cfg.head_dim)
        if self.own_attention and cfg.softcap is None:
            # A bidirectional sliding window (EmbeddingGemma): ModernBERT's windowed attention,
            # Triton or flash on CUDA. Keys at a distance below the window are visible.
            assert self.window is not None, "own attention without soft-capping is windowed"
            attn_out = windowed_attention(
                q, k, v, inputs.attn, scale=cfg.scale, half_window=self.window - 1,
                kernel=kernel,
            )  # fmt: skip
        elif self.own_attention and kernel == "triton":  # soft-capped, in the fused kernel
            attn_out = attend(
                q, k, v, inputs.attn, kv_cache, scale=cfg.scale, window=self.window,
                kernel=kernel, softcap=cfg.softcap,
            )  # fmt: skip
        elif self.own_attention:
            attn_out = softcap_attend(
                q, k, v, inputs.attn, kv_cache, scale=cfg.scale, softcap=cfg.softcap,
                window=self.window,
            )  # fmt: skip
        else:
            attn_out = attend(
                q, k, v, inputs.attn, kv_cache, scale=cfg.scale, window=self.window,
                kernel=kernel,
            )  # fmt: skip
        x, attn_out = kept_rows(x, attn_out, keep)
        mlp = self.mlp_weights()
        if ops.fused_geglu:
            x, gate_up = ops.mlp_in(cfg, x, attn_out, mlp)
            return ops.mlp_out(cfg, x, gated_activation.gelu_tanh_and_mul(gate_up), mlp)
        return ops.post(cfg, x, attn_out, mlp)

    def mlp_weights(self) -> MlpWeights:
        post_attn, post_ff = self.post_attention_layernorm, self.post_feedforward_layernorm
        return MlpWeights(
            self.o_proj.weight, self.o_proj.bias,
            post_attn.weight if post_attn is not None else None,
            self.pre_feedforward_layernorm.weight, self.gate_up_proj.weight,
            self.down_proj.weight, post_ff.weight if post_ff is not None else None,
        )  # fmt: skip


class GemmaStage(StageModel):
    """A slice of a Gemma2 / Gemma3-text model's layers. Causal stages keep a KV cache and take
    prompts in chunks; bidirectional ones (Gemma3 with use_bidirectional_attention) take whole
    prompts. Returns the final-normed hidden states on the last stage (no LM head)."""

    keeps_rows = True

    def __init__(
        self,
        cfg: GemmaConfig,
        layers: range,
        first: bool,
        last: bool,
        max_len: int,
        head: ClassifierHead | None = None,
    ):
        super().__init__(layers, first, last)
        self.cfg = cfg
        self.hidden_size, self.num_layers = cfg.hidden_size, cfg.num_layers
        self.max_positions = cfg.max_positions
        self.causal = cfg.causal
        self.kv_layout = KVLayout(cfg.num_kv_heads, cfg.head_dim) if cfg.causal else None
        # The layers whose attention the chosen kernel computes: all but bidirectional windowed
        # ones (soft-capped ones too, where that kernel is Triton's).
        kernel_layers = [
            i for i in range(cfg.num_layers) if not (cfg.own_attention(i) and cfg.softcap is None)
        ]
        self.attention_shape = AttentionShape(
            cfg.head_dim, cfg.num_heads // cfg.num_kv_heads, causal=cfg.causal,
            windowed=any(cfg.windows[i] is not None for i in kernel_layers),
        )  # fmt: skip
        self.attn_kernel = "portable"
        self.graph_safe = not any(cfg.own_attention(i) for i in range(cfg.num_layers))
        self.ops = GemmaOps()
        if first:
            self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): GemmaLayer(cfg, i) for i in layers})
        self.rotary = nn.ModuleDict(
            {
                kind: RotaryEmbedding(
                    cfg.head_dim, cfg.head_dim, float(params["rope_theta"]), params, max_len
                )
                for kind, params in cfg.rope.items()
                if kind in {cfg.layer_types[i] for i in layers}
            }
        )
        if last:
            self.norm = GemmaNorm(cfg.hidden_size, cfg.rms_norm_eps)
            if head is not None:
                self.score_head = build_score_head(head, cfg.hidden_size, cfg.vocab_size)

    def graph_safe_with(self, kernel: str) -> bool:
        # Triton computes soft-capped attention through attend() (the pieces of a causal
        # stage's graphs run it between them) and bidirectional windows from the step's work
        # list (whole-step graphs).
        return self.graph_safe or kernel == "triton"

    def reset_buffers(self) -> None:
        for rotary in cast("Iterable[RotaryEmbedding]", self.rotary.values()):
            rotary.reset_table()

    def set_compiled(self, on: bool) -> None:
        eager = GemmaOps(fused_qk_rope=self.ops.fused_qk_rope, fused_geglu=self.ops.fused_geglu)
        self.ops = eager.compiled() if on else eager

    def has_fused_kernels(self) -> bool:
        return True

    def use_fused_kernels(self) -> bool:
        """Switch to the Triton q/k-norm + RoPE kernel and the GeGLU one, each where it agrees
        with the eager ops on a random batch through this stage's weights (each RoPE table of
        its layer types); returns whether all of them are in use."""
        cfg = self.cfg
        layer = cast(GemmaLayer, next(iter(self.layers.values())))
        device, dtype = layer.qkv_proj.weight.device, layer.qkv_proj.weight.dtype
        if not qk_rope.available(device, dtype):
            return False
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(97, cfg.hidden_size, device=device, dtype=dtype, generator=gen)
        return self._use_fused_qk_rope(layer, x, gen) & self._use_fused_geglu(layer, x)

    def _use_fused_geglu(self, layer: GemmaLayer, x: torch.Tensor) -> bool:
        fused = gated_activation.available(x.device, x.dtype)
        if self.cfg.activation not in TANH_GELUS or not fused:
            return True  # nothing to replace here
        with torch.inference_mode():
            w = layer.mlp_weights()
            gate_up = F.linear(
                gemma_rms_norm(x, w.pre_feedforward_norm, self.cfg.rms_norm_eps), w.gate_up
            )
            agree = gated_activation.agrees(
                gated_activation.reference(gate_up), gated_activation.gelu_tanh_and_mul(gate_up)
            )
        if agree:
            self.ops = self.ops._replace(fused_geglu=True)
        return agree

    def _use_fused_qk_rope(self, layer: GemmaLayer, x: torch.Tensor, gen: torch.Generator) -> bool:
        cfg, w = self.cfg, layer.attn_weights()
        device = x.device
        agree = True
        for rotary in cast("Iterable[RotaryEmbedding]", self.rotary.values()):
            positions = torch.randint(0, rotary.max_positions, (97,), device=device, generator=gen)
            with torch.inference_mode():
                q, k, _ = qkv_projection(cfg, x, w)
                q, k = apply_rotary(positions, q, k, rotary.cos_sin, cfg.head_dim)
                fused = fused_qk_norm_rope(
                    project_qkv(cfg, x, w), positions, rotary.cos_sin, w.q_norm, w.k_norm,
                    num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                    head_dim=cfg.head_dim, eps=cfg.rms_norm_eps, unit_offset=True,
                )  # fmt: skip
            agree = agree and all(map(qk_rope.agrees, (q, k), fused))
        if agree:
            self.ops = self.ops._replace(fused_qk_rope=True)
        return agree

    def layer_body(self) -> object:
        return self.ops

    def use_layer_body(self, body: object) -> None:
        assert isinstance(body, GemmaOps), "another copy's layer_body()"
        self.ops = body

    def forward(self, x: torch.Tensor, inputs: StepInputs, kv_caches) -> torch.Tensor:
        if self.is_first:
            x = self.embed_tokens(x)
            x = x * embed_scale(self.cfg.hidden_size, x.dtype)
        return self.decoder_layers(x, inputs, kv_caches)

    def decoder_layers(self, x: torch.Tensor, inputs: StepInputs, kv_caches) -> torch.Tensor:
        """The stage's layers on embedded rows (then the final norm on the last stage)."""
        last = len(self.layers) - 1
        for j, layer in enumerate(cast("Iterable[GemmaLayer]", self.layers.values())):
            kv = kv_caches[j] if kv_caches is not None else None
            cos_sin = self.rotary[layer.layer_type].cos_sin
            keep = inputs.keep_rows if self.is_last and j == last else None
            x = layer(x, inputs, kv, cos_sin, self.ops, self.attn_kernel, keep)
        if self.is_last:
            x = self.norm(x)
        return x

    def weight_specs(self) -> list[WeightSpec]:
        cfg, specs = self.cfg, []
        h, inter, bias = cfg.hidden_size, cfg.intermediate_size, cfg.attention_bias
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        if self.is_first:
            specs.append(
                WeightSpec("embed_tokens.weight", (cfg.vocab_size, h), "embed_tokens.weight")
            )
        for i in self.layer_range:
            p = f"layers.{i}"
            specs += [
                WeightSpec(f"{p}.{ckpt}.weight", (h,), f"{p}.{n}.weight")
                for n, ckpt in layer_norm_names(cfg).items()
            ]
            if cfg.qk_norm:
                specs += [
                    WeightSpec(f"{p}.self_attn.{n}.weight", (cfg.head_dim,), f"{p}.{n}.weight")
                    for n in ("q_norm", "k_norm")
                ]
            # (checkpoint name, fused parameter, its rows, with a bias)
            for name, fused, lo, hi, with_bias in (
                ("self_attn.q_proj", "qkv_proj", 0, q, bias),
                ("self_attn.k_proj", "qkv_proj", q, q + kv, bias),
                ("self_attn.v_proj", "qkv_proj", q + kv, q + 2 * kv, bias),
                ("mlp.gate_proj", "gate_up_proj", 0, inter, False),
                ("mlp.up_proj", "gate_up_proj", inter, 2 * inter, False),
            ):
                specs += linear_specs(
                    f"{p}.{name}", f"{p}.{fused}", hi - lo, h, with_bias, (lo, hi)
                )
            specs += linear_specs(f"{p}.self_attn.o_proj", f"{p}.o_proj", h, q, bias)
            specs += linear_specs(f"{p}.mlp.down_proj", f"{p}.down_proj", h, inter, False)
        if self.is_last:
            specs.append(WeightSpec("norm.weight", (h,), "norm.weight"))
        return specs + self.head_specs()
