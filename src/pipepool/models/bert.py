"""Bidirectional encoders: BERT and its relatives (all-MiniLM, BGE, e5; RoBERTa / XLM-R).

Encoders attend over the whole prompt at once, so a prompt is never chunked and no KV cache
is kept; the layers still split into pipeline stages like any other model."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..core.classifier_head import ClassifierHead
from ..errors import ModelLoadError
from ..layers import cpu_lanes, cpu_linear, int8_linear, invariant_ops, invariant_triton
from ..layers.activation import get_activation
from ..layers.attention import AttentionShape, attend
from ..layers.cpu_tiles import Tile, plan_tiles
from ..layers.linear_activation import linear_activation
from ..layers.norm import invariant_row_kernels
from .base import StageModel, StepInputs, WeightSpec, compile_layer_fn, embedding, linear_specs
from .between_layers import between_layers
from .score_heads import build_score_head


@dataclass(frozen=True)
class EncoderConfig:
    """What a BERT / RoBERTa / XLM-R config.json says the encoder computes."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_positions: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    position_offset: int  # RoBERTa counts positions from padding_idx + 1

    @classmethod
    def from_hf(cls, hf: dict, family: str) -> EncoderConfig:
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError(
                f"position_embedding_type {hf['position_embedding_type']!r} is not supported "
                "(absolute is)"
            )
        offset = int(hf.get("pad_token_id", 1)) + 1 if family == "roberta" else 0
        get_activation(hf.get("hidden_act", "gelu"))  # fail at load time, not mid-request
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            max_positions=int(hf.get("max_position_embeddings", 512)) - offset,
            type_vocab_size=int(hf.get("type_vocab_size", 2)),
            layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
            hidden_act=hf.get("hidden_act", "gelu"),
            position_offset=offset,
        )


class FfnWeights(NamedTuple):
    """A BERT layer's tensors after attention, in the order ``post_attention`` takes them:
    output projection, its norm, the feed-forward pair and its norm (weights and biases)."""

    attn_out: torch.Tensor
    attn_out_bias: torch.Tensor
    attn_norm: torch.Tensor
    attn_norm_bias: torch.Tensor
    ffn_in: torch.Tensor
    ffn_in_bias: torch.Tensor
    ffn_out: torch.Tensor
    ffn_out_bias: torch.Tensor
    ffn_norm: torch.Tensor
    ffn_norm_bias: torch.Tensor


def post_attention(
    cfg: EncoderConfig, x: torch.Tensor, a: torch.Tensor, w: FfnWeights
) -> torch.Tensor:
    """x = norm(x + out(attn)); x = norm(x + ffn(x)). a: [T, H, D] attention output."""
    if invariant_row_kernels(x):
        return _post_attention_invariant(cfg, x, a, w)
    h, eps = cfg.hidden_size, cfg.layer_norm_eps
    x = F.layer_norm(
        x + F.linear(a.flatten(1), w.attn_out, w.attn_out_bias),
        (h,),
        w.attn_norm,
        w.attn_norm_bias,
        eps,
    )
    ffn_in = linear_activation(x, w.ffn_in, w.ffn_in_bias, cfg.hidden_act)
    ffn = F.linear(ffn_in, w.ffn_out, w.ffn_out_bias)
    return F.layer_norm(x + ffn, (h,), w.ffn_norm, w.ffn_norm_bias, eps)


def _post_attention_invariant(
    cfg: EncoderConfig, x: torch.Tensor, a: torch.Tensor, w: FfnWeights
) -> torch.Tensor:
    """post_attention in a batch-invariant forward on CUDA: each product's bias, its residual
    and the norm in one per-row pass (``invariant_triton.add_layer_norm``), where the eager
    form spends three passes over the rows."""
    eps = cfg.layer_norm_eps
    y = F.linear(a.flatten(1), w.attn_out)
    x = invariant_triton.add_layer_norm(y, w.attn_out_bias, x, w.attn_norm, w.attn_norm_bias, eps)
    ffn_in = linear_activation(x, w.ffn_in, w.ffn_in_bias, cfg.hidden_act)
    y = F.linear(ffn_in, w.ffn_out)
    return invariant_triton.add_layer_norm(y, w.ffn_out_bias, x, w.ffn_norm, w.ffn_norm_bias, eps)


def post_attention_fused(
    cfg: EncoderConfig, x: torch.Tensor, a: torch.Tensor, w: FfnWeights
) -> torch.Tensor:
    """post_attention on the CPU with bias, activation and residual adds fused into the GEMMs
    (layers/cpu_linear.py); ``w`` holds packed weights for attn_out, ffn_in and ffn_out."""
    h, eps = cfg.hidden_size, cfg.layer_norm_eps
    x = cpu_linear.linear_add(a.flatten(1), x, w.attn_out, w.attn_out_bias)
    x = F.layer_norm(x, (h,), w.attn_norm, w.attn_norm_bias, eps)
    ffn_in = cpu_linear.linear(x, w.ffn_in, w.ffn_in_bias, cfg.hidden_act)
    x = cpu_linear.linear_add(ffn_in, x, w.ffn_out, w.ffn_out_bias)
    return F.layer_norm(x, (h,), w.ffn_norm, w.ffn_norm_bias, eps)


class Int8Linears(NamedTuple):
    """A BERT layer's four projections packed as int8 (layers/int8_linear.py)."""

    qkv: int8_linear.Int8Weight
    attn_out: int8_linear.Int8Weight
    ffn_in: int8_linear.Int8Weight
    ffn_out: int8_linear.Int8Weight


def post_attention_int8(
    cfg: EncoderConfig, x: torch.Tensor, a: torch.Tensor, q: Int8Linears, w: FfnWeights
) -> torch.Tensor:
    """post_attention with the three projections in int8; activation, residual adds and
    norms in fp32 (``w`` gives the norms)."""
    h, eps = cfg.hidden_size, cfg.layer_norm_eps
    y = int8_linear.linear(a.flatten(1), q.attn_out).add_(x)
    x = F.layer_norm(y, (h,), w.attn_norm, w.attn_norm_bias, eps)
    ffn_in = get_activation(cfg.hidden_act)(int8_linear.linear(x, q.ffn_in))
    y = int8_linear.linear(ffn_in, q.ffn_out).add_(x)
    return F.layer_norm(y, (h,), w.ffn_norm, w.ffn_norm_bias, eps)


def embed(
    ids: torch.Tensor,
    positions: torch.Tensor,
    types: torch.Tensor | None,
    word: torch.Tensor,
    position: torch.Tensor,
    token_type: torch.Tensor,
    norm: torch.Tensor,
    norm_bias: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """norm(word[ids] + position[positions] + token_type[types]); ``positions`` already
    offset. Single texts are token type 0 throughout, as sentence-transformers feeds them;
    pairs (cross-encoders) carry the types their tokenizer gave each token. Compiled, the
    three lookups, the sums and the norm are one kernel."""
    x = F.embedding(ids, word) + F.embedding(positions, position)
    x = x + (F.embedding(types, token_type) if types is not None else token_type[0])
    return F.layer_norm(x, (word.shape[1],), norm, norm_bias, eps)


class EncoderLayer(nn.Module):
    """Post-norm block: x = norm(x + attn(x)); x = norm(x + ffn(x))."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_heads, self.head_dim = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        h = cfg.hidden_size
        self.qkv_proj = nn.Linear(h, 3 * h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.ffn_in = nn.Linear(h, cfg.intermediate_size)
        self.ffn_out = nn.Linear(cfg.intermediate_size, h)
        self.ffn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.scale = self.head_dim**-0.5
        self._packed = cpu_linear.PackedWeights()  # see packed_ffn_weights
        self._packed_qkv = cpu_linear.PackedWeights()  # see forward_fused
        self._int8: Int8Linears | None = None  # see quantize_int8

    def ffn_weights(self) -> FfnWeights:
        return FfnWeights(
            self.attn_out.weight, self.attn_out.bias, self.attn_norm.weight, self.attn_norm.bias,
            self.ffn_in.weight, self.ffn_in.bias, self.ffn_out.weight, self.ffn_out.bias,
            self.ffn_norm.weight, self.ffn_norm.bias,
        )  # fmt: skip

    def forward(self, x: torch.Tensor, inputs: StepInputs, post, kernel: str) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).view(-1, 3 * self.num_heads, self.head_dim).chunk(3, dim=1)
        a = attend(q, k, v, inputs.attn, None, scale=self.scale, kernel=kernel)  # [T, H, D]
        return post(self.cfg, x, a, self.ffn_weights())

    def forward_fused(self, x: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        """CPU: the same block with every linear through oneDNN's packed GEMMs, the
        post-attention ones with their epilogues fused. (The q|k|v projection has no epilogue
        to fuse; packed, it ran at 197 GFLOP/s against 149 for ``F.linear`` and 122 for MKL's
        addmm at 2048 rows on 2 AMD EPYC cores, and at 298 against 311 for addmm on 2 Sapphire
        Rapids cores.)"""
        (qkv,) = self._packed_qkv.of(self.qkv_proj.weight)
        q, k, v = (
            cpu_linear.linear(x, qkv, self.qkv_proj.bias)
            .view(-1, 3 * self.num_heads, self.head_dim)
            .chunk(3, dim=1)
        )
        a = attend(q, k, v, inputs.attn, None, scale=self.scale)  # [T, H, D]
        return post_attention_fused(self.cfg, x, a, self.packed_ffn_weights())

    def quantize_int8(self) -> None:
        """Pack the four projections as int8 for :meth:`forward_int8` (once, after loading:
        later writes to the fp32 weights are not seen)."""
        linears = (self.qkv_proj, self.attn_out, self.ffn_in, self.ffn_out)
        self._int8 = Int8Linears(*(int8_linear.pack(m.weight, m.bias) for m in linears))

    def forward_int8(self, x: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        """CPU, ``dtype="int8"``: the block with every projection a dynamic int8 GEMM."""
        q8 = self._int8
        assert q8 is not None, "quantize_int8() first"
        qkv = int8_linear.linear(x, q8.qkv)  # [T, 3 * hidden]
        q, k, v = qkv.view(-1, 3 * self.num_heads, self.head_dim).chunk(3, dim=1)
        a = attend(q, k, v, inputs.attn, None, scale=self.scale)  # [T, H, D]
        return post_attention_int8(self.cfg, x, a, q8, self.ffn_weights())

    def packed_ffn_weights(self) -> FfnWeights:
        """ffn_weights() with oneDNN copies of the three projection weights, packed on first use
        and again whenever one of them was written since (its version counter moved)."""
        attn_out, ffn_in, ffn_out = self._packed.of(
            self.attn_out.weight, self.ffn_in.weight, self.ffn_out.weight
        )
        return self.ffn_weights()._replace(attn_out=attn_out, ffn_in=ffn_in, ffn_out=ffn_out)


class EncoderStage(StageModel):
    """A slice of a BERT-style encoder's layers (the first stage also embeds): bidirectional,
    whole prompts, no KV cache."""

    causal = False
    kv_layout = None
    # The family's functions around attention (its own ``embed``: encoders.py, deberta.py), or
    # their torch.compile'd graphs.
    post: Callable[..., torch.Tensor]
    embed: Callable[..., torch.Tensor]
    # First stage: tables that BERT has and some of its relatives do not.
    position_embeddings: nn.Embedding | None
    token_type_embeddings: nn.Embedding | None

    def __init__(
        self,
        cfg: EncoderConfig,
        layers: range,
        first: bool,
        last: bool,
        max_len: int,
        head: ClassifierHead | None = None,
    ):
        self._init_body(cfg, layers, first, last)
        h = cfg.hidden_size
        if first:
            self.word_embeddings = embedding(cfg.vocab_size, h)
            self.position_embeddings = embedding(cfg.max_positions + cfg.position_offset, h)
            self.token_type_embeddings = embedding(cfg.type_vocab_size, h)
            self.emb_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleDict({str(i): EncoderLayer(cfg) for i in layers})
        if last and head is not None:
            self.score_head = build_score_head(head, h, cfg.vocab_size)

    @classmethod
    def honours_key_lengths(cls, cfg: Any) -> bool:
        return True  # every layer attends through attend()

    @classmethod
    def supports_int8(cls, cfg: Any) -> bool:
        return True  # EncoderLayer.forward_int8

    def quantize_int8(self) -> None:
        for layer in cast("Iterable[EncoderLayer]", self.layers.values()):
            layer.quantize_int8()
        self.int8 = True

    def _init_body(self, cfg: EncoderConfig, layers: range, first: bool, last: bool) -> None:
        """What every BERT-style encoder stage sets before its own embeddings and layers (the
        relatives in encoders.py and deberta.py build theirs, around the same block)."""
        StageModel.__init__(self, layers, first, last)
        self.cfg = cfg
        self.hidden_size, self.num_layers = cfg.hidden_size, cfg.num_layers
        self.max_positions = cfg.max_positions
        self.attention_shape = AttentionShape(
            cfg.hidden_size // cfg.num_heads, 1, causal=False, windowed=False
        )
        self.attn_kernel = "portable"
        self.post = post_attention  # or one torch.compile'd graph shared by every layer
        self.embed = embed  # or its torch.compile'd graph (first stage)
        self.int8 = False  # the layers run forward_int8 (quantize_int8; CPU only)

    def forward(self, x: torch.Tensor, inputs: StepInputs, kv_caches=None) -> torch.Tensor:
        if x.device.type == "cpu":
            return self._forward_tiles(x, inputs)
        return self._forward_rows(x, inputs)

    def _forward_tiles(self, x: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        """CPU: the step as cache-sized tiles of length-sorted requests (layers/cpu_tiles.py),
        side by side on single-threaded lanes (layers/cpu_lanes.py)."""
        fused = self._fused_on_cpu()
        if len(inputs.attn.cu_q_host) <= 2:  # at most one request: nothing to sort or cut
            return self._forward_rows(x, inputs, fused)
        out = x.new_empty((x.shape[0], self.hidden_size), dtype=self._param_dtype())

        def forward_tile(tile: Tile) -> None:
            types = inputs.token_type_ids
            tile_inputs = StepInputs(
                inputs.positions.index_select(0, tile.rows),
                tile.meta,
                types.index_select(0, tile.rows) if types is not None else None,
            )
            y = self._forward_rows(x.index_select(0, tile.rows), tile_inputs, fused)
            out.index_copy_(0, tile.rows, y)

        # Lanes for the eager layers only: a torch.compile'd body is not run from two threads,
        # and batch_invariant's kernels are chosen per thread (invariant_ops is thread-local).
        eager = self.post is post_attention and not invariant_ops.active()
        lanes = cpu_lanes.lanes_here() if eager else None
        tiles = plan_tiles(
            inputs.attn.cu_q_host, key_lens=inputs.attn.key_lens, lanes=lanes.size if lanes else 1
        )
        cpu_lanes.run_tiles(forward_tile, tiles, lanes)
        return out

    def _param_dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def _fused_on_cpu(self) -> bool:
        """oneDNN fused linears where they apply: eager (a torch.compile'd body keeps its own
        fusion), a dtype and an activation oneDNN runs here (``cpu_linear.packs``). bf16 on 2
        AMD EPYC (Zen 4) cores, bundled MiniLM, 2,000 short queries: 304 texts/s packed against
        286 for ``F.linear``."""
        return (
            self.post is post_attention
            and not invariant_ops.active()  # its fixed-shape products are F.linear's
            and cpu_linear.fusable(self.cfg.hidden_act)
            and cpu_linear.packs(self._param_dtype())
        )

    def _forward_rows(self, x: torch.Tensor, inputs: StepInputs, fused: bool = False):
        if self.is_first:
            position, token_type = self.position_embeddings, self.token_type_embeddings
            assert position is not None and token_type is not None  # BERT's has both tables
            x = self.embed(
                x, inputs.positions + self.cfg.position_offset, inputs.token_type_ids,
                self.word_embeddings.weight, position.weight,
                token_type.weight, self.emb_norm.weight, self.emb_norm.bias,
                self.cfg.layer_norm_eps,
            )  # fmt: skip
        for layer in cast("Iterable[EncoderLayer]", self.layers.values()):
            between_layers()
            if self.int8:
                x = layer.forward_int8(x, inputs)
            elif fused:
                x = layer.forward_fused(x, inputs)
            else:
                x = layer(x, inputs, self.post, self.attn_kernel)
        return x

    def set_compiled(self, on: bool) -> None:
        self.post = (
            compile_layer_fn(post_attention, round_like_eager=False) if on else post_attention
        )
        self.embed = compile_layer_fn(embed, round_like_eager=False) if on else embed

    def layer_body(self) -> object:
        return self.post, self.embed

    def use_layer_body(self, body: object) -> None:
        assert isinstance(body, tuple), "another copy's layer_body(): (post, embed)"
        self.post, self.embed = body

    def weight_specs(self) -> list[WeightSpec]:
        cfg, h = self.cfg, self.cfg.hidden_size
        specs: list[WeightSpec] = []
        if self.is_first:
            pos_rows = cfg.max_positions + cfg.position_offset
            specs += [
                WeightSpec(
                    "embeddings.word_embeddings.weight",
                    (cfg.vocab_size, h),
                    "word_embeddings.weight",
                ),
                WeightSpec(
                    "embeddings.position_embeddings.weight",
                    (pos_rows, h),
                    "position_embeddings.weight",
                ),
                WeightSpec(
                    "embeddings.token_type_embeddings.weight",
                    (cfg.type_vocab_size, h),
                    "token_type_embeddings.weight",
                ),
                *norm_specs("embeddings.LayerNorm", "emb_norm", h),
            ]
        for i in self.layer_range:
            c, p = f"encoder.layer.{i}", f"layers.{i}"
            for j, name in enumerate(("query", "key", "value")):
                specs += linear_specs(
                    f"{c}.attention.self.{name}", f"{p}.qkv_proj", h, h, True, (j * h, (j + 1) * h)
                )
            specs += linear_specs(f"{c}.attention.output.dense", f"{p}.attn_out", h, h, True)
            specs += norm_specs(f"{c}.attention.output.LayerNorm", f"{p}.attn_norm", h)
            specs += linear_specs(
                f"{c}.intermediate.dense", f"{p}.ffn_in", cfg.intermediate_size, h, True
            )
            specs += linear_specs(
                f"{c}.output.dense", f"{p}.ffn_out", h, cfg.intermediate_size, True
            )
            specs += norm_specs(f"{c}.output.LayerNorm", f"{p}.ffn_norm", h)
        return specs + self.head_specs()


def norm_specs(ckpt: str, param: str, dim: int) -> list[WeightSpec]:
    return [
        WeightSpec(f"{ckpt}.weight", (dim,), f"{param}.weight"),
        WeightSpec(f"{ckpt}.bias", (dim,), f"{param}.bias"),
    ]
