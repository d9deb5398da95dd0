"""Causal decoder families: Llama, Mistral, Qwen2, Qwen3 (Qwen3-Embedding, gte-Qwen2,
e5-mistral). One implementation; the families differ only in the switches of DecoderConfig."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..core.classifier_head import ClassifierHead
from ..errors import ModelLoadError
from ..layers import cpu_linear, gated_activation, invariant_ops, qk_rope
from ..layers.attention import AttentionShape, attend
from ..layers.cpu_tiles import in_row_tiles
from ..layers.norm import RMSNorm, rms_norm
from ..layers.qk_rope import fused_qk_norm_rope
from ..layers.rotary import RotaryEmbedding, apply_rotary
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
from .score_heads import build_score_head


@dataclass(frozen=True)
class DecoderConfig:
    """What a Qwen3 / Qwen2 / Llama / Mistral config.json says the decoder computes."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    rotary_dim: int
    max_positions: int
    qkv_bias: bool  # bias on q/k/v projections
    o_bias: bool  # bias on the output projection
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    windows: tuple[int | None, ...]  # sliding window per layer (None = full causal)
    # False: every token attends to the whole prompt (``is_causal: false`` checkpoints such as
    # gte-Qwen2-instruct); such prompts run whole, like an encoder's, with no KV cache.
    causal: bool = True

    @classmethod
    def from_hf(cls, hf: dict, family: str, *, causal: bool = True) -> DecoderConfig:
        if hf.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(
                f"{family}: hidden_act {hf['hidden_act']!r} is not supported (silu)"
            )
        hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hidden // heads
        rope_params: dict[str, Any] = dict(hf.get("rope_parameters") or {})
        theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        scaling = hf.get("rope_scaling") or rope_params or None
        if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
        partial = float(
            rope_params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        )
        num_layers = hf["num_hidden_layers"]
        bias = bool(hf.get("attention_bias", False))
        windows = _sliding_windows(hf, family, num_layers)
        if not causal and any(w is not None for w in windows):
            raise ModelLoadError(
                f"{family}: bidirectional attention with a sliding window (sliding_window="
                f"{hf.get('sliding_window')}) is not implemented"
            )
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            rotary_dim=int(head_dim * partial),
            max_positions=int(hf.get("max_position_embeddings", 32768)),
            qkv_bias=True if family == "qwen2" else bias,
            o_bias=False if family == "qwen2" else bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            windows=windows,
            causal=causal,
        )


def _sliding_windows(hf: dict, family: str, num_layers: int) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    if family == "mistral":  # Mistral applies its window on every layer when one is set
        return (window,) * num_layers
    if family in ("qwen2", "qwen3"):
        if not hf.get("use_sliding_window", False) or window is None:
            return (None,) * num_layers
        types = hf.get("layer_types") or [
            "sliding_attention"
            if i >= hf.get("max_window_layers", num_layers)
            else "full_attention"
            for i in range(num_layers)
        ]
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (None,) * num_layers


class AttnWeights(NamedTuple):
    """What a decoder block needs before attention (None where the checkpoint has no such
    tensor); Gemma's blocks too."""

    norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


class MlpWeights(NamedTuple):
    """What the block needs after attention."""

    o: torch.Tensor
    o_bias: torch.Tensor | None
    norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


def project_qkv(cfg: DecoderConfig, x: torch.Tensor, w: AttnWeights) -> torch.Tensor:
    """norm -> fused q|k|v projection. x: [T, hidden] -> [T, (Hq + 2 Hkv) * D]."""
    return F.linear(rms_norm(x, w.norm, cfg.rms_norm_eps), w.qkv, w.qkv_bias)


def qkv_projection(
    cfg: DecoderConfig,
    x: torch.Tensor,
    w: AttnWeights,
    project: Callable[[DecoderConfig, torch.Tensor, AttnWeights], torch.Tensor] = project_qkv,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """norm -> fused q|k|v projection -> (Qwen3) q/k norm. x: [T, hidden]."""
    q, k, v = split_heads(cfg, project(cfg, x, w))
    if w.q_norm is not None and w.k_norm is not None:  # both or neither (Qwen3)
        q, k = rms_norm(q, w.q_norm, cfg.rms_norm_eps), rms_norm(k, w.k_norm, cfg.rms_norm_eps)
    return q, k, v


class HeadShape(Protocol):
    """A config's attention heads: DecoderConfig's, GemmaConfig's."""

    @property
    def num_heads(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


def split_heads(cfg: HeadShape, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[T, (Hq + 2 Hkv) * D] -> q [T, Hq, D], k and v [T, Hkv, D]; ``cfg``: any config with
    ``num_heads``, ``num_kv_heads`` and ``head_dim`` (Gemma's too)."""
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
    q = q.view(-1, cfg.num_heads, cfg.head_dim)  # [T, Hq, D]
    k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)  # [T, Hkv, D]
    v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
    return q, k, v


def post_attention(
    cfg: DecoderConfig, x: torch.Tensor, attn_out: torch.Tensor, w: MlpWeights
) -> torch.Tensor:
    """Output projection + residual, then norm -> SwiGLU MLP + residual."""
    x = x + F.linear(attn_out.flatten(1), w.o, w.o_bias)
    gate_up = F.linear(rms_norm(x, w.norm, cfg.rms_norm_eps), w.gate_up, w.gate_up_bias)
    return x + F.linear(swiglu(gate_up), w.down, w.down_bias)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the fused gate|up projection; one Triton kernel in a
    batch-invariant forward on CUDA, which runs without ``torch.compile`` to fuse the two."""
    if not torch.compiler.is_compiling() and gate_up.is_cuda and invariant_ops.active():
        return gated_activation.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


def project_qkv_packed(cfg: DecoderConfig, x: torch.Tensor, w: AttnWeights) -> torch.Tensor:
    """project_qkv on the CPU with ``w.qkv`` a oneDNN-packed weight (layers/cpu_linear.py)."""
    return cpu_linear.linear(rms_norm(x, w.norm, cfg.rms_norm_eps), w.qkv, w.qkv_bias)


def post_attention_packed(
    cfg: DecoderConfig, x: torch.Tensor, attn_out: torch.Tensor, w: MlpWeights
) -> torch.Tensor:
    """post_attention on the CPU with oneDNN-packed weights, both residual adds in the GEMMs'
    epilogues (layers/cpu_linear.py)."""
    x = cpu_linear.linear_add(attn_out.flatten(1), x, w.o, w.o_bias)
    h = rms_norm(x, w.norm, cfg.rms_norm_eps)
    gate, up = cpu_linear.linear(h, w.gate_up, w.gate_up_bias).chunk(2, -1)
    return cpu_linear.linear_add(F.silu(gate) * up, x, w.down, w.down_bias)


class LayerOps(NamedTuple):
    """The pieces around attention: plain functions, or torch.compile'd graphs shared by every
    layer (weights are arguments, so layers do not recompile). RoPE is a graph of its own:
    fused with the q/k norm's reduction, inductor recomputed the norm per element (measured
    1.3 ms instead of ~0.1 ms per layer on an H200 at 32k tokens)."""

    qkv: Callable[
        [DecoderConfig, torch.Tensor, AttnWeights], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ] = qkv_projection
    rope: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int],
        tuple[torch.Tensor, torch.Tensor],
    ] = apply_rotary
    post: Callable[[DecoderConfig, torch.Tensor, torch.Tensor, MlpWeights], torch.Tensor] = (
        post_attention
    )
    # The fused q/k-norm + RoPE kernel path starts from here.
    project: Callable[[DecoderConfig, torch.Tensor, AttnWeights], torch.Tensor] = project_qkv
    fused_qk_rope: bool = False  # q/k norm + RoPE in one Triton kernel (CUDA)


class DecoderLayer(nn.Module):
    """Pre-norm block: x += attn(norm(x)); x += mlp(norm(x)). q|k|v and gate|up are fused."""

    def __init__(self, cfg: DecoderConfig, window: int | None) -> None:
        super().__init__()
        self.cfg, self.window = cfg, window
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_dim + 2 * kv_dim, bias=cfg.qkv_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.scale = cfg.head_dim**-0.5
        self._packed = cpu_linear.PackedWeights()  # see packed_weights

    def attn_weights(self) -> AttnWeights:
        qk = self.cfg.qk_norm
        return AttnWeights(
            self.input_layernorm.weight,
            self.qkv_proj.weight,
            self.qkv_proj.bias,
            self.q_norm.weight if qk else None,
            self.k_norm.weight if qk else None,
        )

    def mlp_weights(self) -> MlpWeights:
        return MlpWeights(
            self.o_proj.weight,
            self.o_proj.bias,
            self.post_attention_layernorm.weight,
            self.gate_up_proj.weight,
            self.gate_up_proj.bias,
            self.down_proj.weight,
            self.down_proj.bias,
        )

    def packed_weights(self) -> tuple[AttnWeights, MlpWeights]:
        """attn_weights() and mlp_weights() with oneDNN copies of the four projections."""
        qkv, o, gate_up, down = self._packed.of(
            self.qkv_proj.weight, self.o_proj.weight, self.gate_up_proj.weight,
            self.down_proj.weight,
        )  # fmt: skip
        return (
            self.attn_weights()._replace(qkv=qkv),
            self.mlp_weights()._replace(o=o, gate_up=gate_up, down=down),
        )

    def forward(
        self, x, inputs: StepInputs, kv_cache, cos_sin, ops: LayerOps, kernel: str, keep=None
    ):
        """``keep``: the rows to go on with after attention (``StepInputs.keep_rows``), on
        the last stage's last layer; None: all."""
        if packed_on_cpu(x, ops):
            return self.forward_packed(x, inputs, kv_cache, cos_sin, ops, keep)
        cfg, w = self.cfg, self.attn_weights()
        if ops.fused_qk_rope:
            qkv = ops.project(cfg, x, w)
            q, k = fused_qk_norm_rope(
                qkv, inputs.positions, cos_sin, w.q_norm, w.k_norm,
                num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, eps=cfg.rms_norm_eps,
            )  # fmt: skip
            v = split_heads(cfg, qkv)[2]
        else:
            q, k, v = ops.qkv(cfg, x, w)
            q, k = ops.rope(inputs.positions, q, k, cos_sin, cfg.rotary_dim)
        attn_out = attend(
            q, k, v, inputs.attn, kv_cache, scale=self.scale, window=self.window, kernel=kernel
        )
        x, attn_out = kept_rows(x, attn_out, keep)
        mlp = self.mlp_weights()
        if x.device.type == "cpu" and ops.post is post_attention:  # eager: keep it in cache
            return in_row_tiles(lambda xs, a: post_attention(cfg, xs, a, mlp), x, attn_out)
        return ops.post(cfg, x, attn_out, mlp)

    def forward_packed(self, x, inputs: StepInputs, kv_cache, cos_sin, ops: LayerOps, keep):
        """CPU, eager: forward with every projection a oneDNN GEMM on packed weights
        (``packed_on_cpu``)."""
        cfg = self.cfg
        w, mlp = self.packed_weights()
        q, k, v = qkv_projection(cfg, x, w, project=project_qkv_packed)
        q, k = ops.rope(inputs.positions, q, k, cos_sin, cfg.rotary_dim)
        attn_out = attend(q, k, v, inputs.attn, kv_cache, scale=self.scale, window=self.window)
        x, attn_out = kept_rows(x, attn_out, keep)
        return in_row_tiles(lambda xs, a: post_attention_packed(cfg, xs, a, mlp), x, attn_out)


def packed_on_cpu(x: torch.Tensor, ops: LayerOps) -> bool:
    """Whether a layer runs its projections through oneDNN's packed GEMMs: on the CPU, eager (a
    torch.compile'd body keeps its own kernels), in a dtype oneDNN runs here
    (``cpu_linear.packs``). Measured on 2 AMD EPYC (Zen 4) cores, torch 2.13, fp32, Qwen3-0.6B's
    shapes at 512 rows: 197-215 GFLOP/s packed against 145-170 for ``F.linear``
    (``benchmarks/cpu_gemm.py --model qwen3-0.6b``); the Qwen3-0.6B shape embedded 1.37x as
    many short queries a second."""
    return (
        x.device.type == "cpu"
        and ops.post is post_attention
        and not invariant_ops.active()  # its fixed-shape products are F.linear's
        and cpu_linear.packs(x.dtype)
    )


class DecoderStage(StageModel):
    """A slice of a decoder's layers. Causal or bidirectional as its config says: causal
    stages keep a KV cache and take prompts in chunks; bidirectional ones take whole prompts."""

    keeps_rows = True

    def __init__(
        self,
        cfg: DecoderConfig,
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
        self.attention_shape = AttentionShape(
            cfg.head_dim, cfg.num_heads // cfg.num_kv_heads, causal=cfg.causal,
            windowed=any(w is not None for w in cfg.windows),
        )  # fmt: skip
        self.attn_kernel = "portable"
        self.ops = LayerOps()
        if first:
            self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, cfg.windows[i]) for i in layers})
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, max_len
        )
        if last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            if head is not None:
                self.score_head = build_score_head(head, cfg.hidden_size, cfg.vocab_size)

    @classmethod
    def honours_key_lengths(cls, cfg: Any) -> bool:
        # Bidirectional ones attend through attend() over whole prompts (never windowed);
        # causal ones chunk prompts, whose later chunks would read the unkeyed tokens' K/V.
        return not cfg.causal

    def reset_buffers(self) -> None:
        self.rotary.reset_table()

    def set_compiled(self, on: bool) -> None:
        fused = self.ops.fused_qk_rope
        self.ops = LayerOps(fused_qk_rope=fused)
        if on:
            qkv, rope, post, project = (
                compile_layer_fn(fn, round_like_eager=True) for fn in LayerOps()[:-1]
            )
            self.ops = LayerOps(qkv, rope, post, project, fused_qk_rope=fused)

    def layer_body(self) -> object:
        return self.ops

    def use_layer_body(self, body: object) -> None:
        assert isinstance(body, LayerOps), "another copy's layer_body()"
        self.ops = body

    def has_fused_kernels(self) -> bool:
        return True

    def use_fused_kernels(self) -> bool:
        """Switch to the Triton q/k-norm + RoPE kernel where it applies and agrees with the
        eager ops on a random batch; returns whether it is now in use."""
        cfg = self.cfg
        device, dtype = self.rotary.cos_sin.device, next(self.parameters()).dtype
        if not qk_rope.available(device, dtype) or cfg.rotary_dim != cfg.head_dim:
            return False
        layer = cast(DecoderLayer, next(iter(self.layers.values())))
        w = layer.attn_weights()
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(97, cfg.hidden_size, device=device, dtype=dtype, generator=gen)
        positions = torch.randint(0, self.rotary.max_positions, (97,), device=device, generator=gen)
        with torch.inference_mode():
            q, k, _ = qkv_projection(cfg, x, w)
            q, k = apply_rotary(positions, q, k, self.rotary.cos_sin, cfg.rotary_dim)
            qf, kf = fused_qk_norm_rope(
                project_qkv(cfg, x, w), positions, self.rotary.cos_sin, w.q_norm, w.k_norm,
                num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, eps=cfg.rms_norm_eps,
            )  # fmt: skip
        agree = qk_rope.agrees(q, qf) and qk_rope.agrees(k, kf)
        if agree:
            self.ops = self.ops._replace(fused_qk_rope=True)
        return agree

    def forward(self, x: torch.Tensor, inputs: StepInputs, kv_caches) -> torch.Tensor:
        if self.is_first:
            x = self.embed_tokens(x)
        last = len(self.layers) - 1
        for j, layer in enumerate(self.layers.values()):
            kv = kv_caches[j] if kv_caches is not None else None
            keep = inputs.keep_rows if self.is_last and j == last else None
            x = layer(x, inputs, kv, self.rotary.cos_sin, self.ops, self.attn_kernel, keep)
        if self.is_last:
            x = self.norm(x)
        return x

    def weight_specs(self) -> list[WeightSpec]:
        cfg = self.cfg
        h, q_dim, kv_dim = (
            cfg.hidden_size,
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
        )
        specs: list[WeightSpec] = []
        if self.is_first:
            specs.append(
                WeightSpec("embed_tokens.weight", (cfg.vocab_size, h), "embed_tokens.weight")
            )
        for i in self.layer_range:
            c, p = f"layers.{i}", f"layers.{i}"
            specs.append(
                WeightSpec(f"{c}.input_layernorm.weight", (h,), f"{p}.input_layernorm.weight")
            )
            for name, lo, hi in (
                ("q_proj", 0, q_dim),
                ("k_proj", q_dim, q_dim + kv_dim),
                ("v_proj", q_dim + kv_dim, q_dim + 2 * kv_dim),
            ):
                specs += linear_specs(
                    f"{c}.self_attn.{name}", f"{p}.qkv_proj", hi - lo, h, cfg.qkv_bias, (lo, hi)
                )
            if cfg.qk_norm:
                for name in ("q_norm", "k_norm"):
                    specs.append(
                        WeightSpec(
                            f"{c}.self_attn.{name}.weight", (cfg.head_dim,), f"{p}.{name}.weight"
                        )
                    )
            specs += linear_specs(f"{c}.self_attn.o_proj", f"{p}.o_proj", h, q_dim, cfg.o_bias)
            specs.append(
                WeightSpec(
                    f"{c}.post_attention_layernorm.weight",
                    (h,),
                    f"{p}.post_attention_layernorm.weight",
                )
            )
            inter = cfg.intermediate_size
            specs += linear_specs(
                f"{c}.mlp.gate_proj", f"{p}.gate_up_proj", inter, h, cfg.mlp_bias, (0, inter)
            )
            specs += linear_specs(
                f"{c}.mlp.up_proj", f"{p}.gate_up_proj", inter, h, cfg.mlp_bias, (inter, 2 * inter)
            )
            specs += linear_specs(f"{c}.mlp.down_proj", f"{p}.down_proj", h, inter, cfg.mlp_bias)
        if self.is_last:
            specs.append(WeightSpec("norm.weight", (h,), "norm.weight"))
        return specs + self.head_specs()
