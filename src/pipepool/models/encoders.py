"""BERT's relatives with embeddings and tensor names of their own: DistilBERT, ELECTRA, MPNet.

Each runs BERT's post-norm block (models/bert.py: ``EncoderLayer``, ``post_attention``) and
differs only where its config and checkpoint say:

- DistilBERT (msmarco-distilbert-*): word + position embeddings, no token types. Its config
  names the shape ``dim`` / ``hidden_dim`` / ``n_layers`` / ``n_heads`` / ``activation``, and
  every LayerNorm's eps is 1e-12 (fixed in transformers). ``sinusoidal_pos_embds`` only
  initialises the position table, which checkpoints store and transformers then looks up as
  stored; so does this (a checkpoint without the table fails to load, naming it).
- ELECTRA (cross-encoder/ms-marco-electra-base): BERT's embeddings, at ``embedding_size``, then
  ``embeddings_project`` to ``hidden_size`` where the two differ.
- MPNet (all-mpnet-base-v2, multi-qa-mpnet): RoBERTa's positions (counted from transformers'
  fixed padding_idx 1, plus one), no token types, and a relative position bias added to every
  layer's attention scores: ``encoder.relative_attention_bias`` ([buckets, heads]) looked up by
  the bucket of each key-minus-query distance (layers/relative_attention.py, as T5's). Every
  stage holds the table. Where the deployment runs the Triton attention kernel, the kernel
  adds the bias itself (one launch a layer, and CUDA graphs of the whole step); elsewhere the
  step attends in groups of padded prompts with the bias as a mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..core.classifier_head import ClassifierHead
from ..layers.activation import get_activation
from ..layers.attention import AttentionMetadata
from ..layers.relative_attention import (
    BiasedAttentionPlan,
    RelativePositionBias,
    biased_attention,
    biased_varlen_attention,
)
from . import bert
from .base import StepInputs, WeightSpec, compile_layer_fn, embedding, linear_specs
from .bert import EncoderConfig, EncoderLayer, EncoderStage, norm_specs, post_attention
from .between_layers import between_layers
from .score_heads import build_score_head

# transformers' MPNet buckets distances into 32 buckets up to 128 apart whatever its table's
# size (MPNetEncoder.compute_position_bias), and counts positions from its padding_idx 1.
_MPNET_BUCKETS, _MPNET_MAX_DISTANCE, _MPNET_PADDING_IDX = 32, 128, 1


@dataclass(frozen=True)
class TensorNames:
    """Where a family keeps layer i's tensors: ``{layers}.{i}.{q}.weight`` and so on."""

    layers: str
    q: str
    k: str
    v: str
    attn_out: str
    attn_norm: str
    ffn_in: str
    ffn_out: str
    ffn_norm: str


_NAMES = {
    "distilbert": TensorNames(
        "transformer.layer", "attention.q_lin", "attention.k_lin", "attention.v_lin",
        "attention.out_lin", "sa_layer_norm", "ffn.lin1", "ffn.lin2", "output_layer_norm",
    ),
    "electra": TensorNames(
        "encoder.layer", "attention.self.query", "attention.self.key", "attention.self.value",
        "attention.output.dense", "attention.output.LayerNorm", "intermediate.dense",
        "output.dense", "output.LayerNorm",
    ),
    "mpnet": TensorNames(
        "encoder.layer", "attention.attn.q", "attention.attn.k", "attention.attn.v",
        "attention.attn.o", "attention.LayerNorm", "intermediate.dense", "output.dense",
        "output.LayerNorm",
    ),
}  # fmt: skip


@dataclass(frozen=True)
class RelativeConfig:
    """One of BERT's relatives: BERT's block shape plus what its embeddings and attention add."""

    family: str  # distilbert | electra | mpnet
    block: EncoderConfig  # vocabulary, positions and the shape of BERT's block
    embedding_size: int  # of the embedding tables; ELECTRA projects it to hidden_size
    token_types: bool  # the embeddings add a token-type row (ELECTRA)
    relative_buckets: int  # rows of MPNet's relative_attention_bias; 0: no position bias

    @property
    def names(self) -> TensorNames:
        return _NAMES[self.family]

    @classmethod
    def from_hf(cls, hf: dict, family: str, *, causal: bool = False) -> RelativeConfig:
        assert not causal, "encoders attend bidirectionally"
        if family == "distilbert":
            get_activation(hf.get("activation", "gelu"))  # fail at load time, not mid-request
            block = EncoderConfig(
                vocab_size=hf["vocab_size"],
                hidden_size=hf["dim"],
                intermediate_size=hf["hidden_dim"],
                num_layers=hf["n_layers"],
                num_heads=hf["n_heads"],
                max_positions=int(hf.get("max_position_embeddings", 512)),
                type_vocab_size=0,
                layer_norm_eps=1e-12,
                hidden_act=hf.get("activation", "gelu"),
                position_offset=0,
            )
            return cls(family, block, block.hidden_size, False, 0)
        block = EncoderConfig.from_hf(hf, family)
        if family == "electra":
            embedding_size = int(hf.get("embedding_size", block.hidden_size))
            return cls(family, block, embedding_size, True, 0)
        assert family == "mpnet", family
        offset = _MPNET_PADDING_IDX + 1
        block = dataclasses.replace(
            block,
            type_vocab_size=0,
            position_offset=offset,
            max_positions=int(hf.get("max_position_embeddings", 512)) - offset,
        )
        buckets = int(hf.get("relative_attention_num_buckets", _MPNET_BUCKETS))
        return cls(family, block, block.hidden_size, False, buckets)


def embed(
    ids: torch.Tensor,
    positions: torch.Tensor,
    types: torch.Tensor | None,
    word: torch.Tensor,
    position: torch.Tensor,
    token_type: torch.Tensor | None,
    norm: torch.Tensor,
    norm_bias: torch.Tensor,
    eps: float,
    project: torch.Tensor | None,
    project_bias: torch.Tensor | None,
) -> torch.Tensor:
    """norm(word[ids] + position[positions] (+ token_type[types])), then ELECTRA's projection
    where it has one; ``positions`` already offset. ``token_type`` None: the family has no token
    types (``types`` is not read); else as ``bert.embed``."""
    if token_type is not None:
        x = bert.embed(ids, positions, types, word, position, token_type, norm, norm_bias, eps)
    else:
        x = F.embedding(ids, word) + F.embedding(positions, position)
        x = F.layer_norm(x, (word.shape[1],), norm, norm_bias, eps)
    return F.linear(x, project, project_bias) if project is not None else x


# A step's relative position bias, as its layers read it: padded groups with their masks, or
# (the Triton kernel) the bias by distance, [heads, 2 * max_distance + 1].
StepBias = BiasedAttentionPlan | torch.Tensor


class BiasedEncoderLayer(EncoderLayer):
    """``EncoderLayer`` whose attention adds a bias to the scores (MPNet's relative position
    bias): the same modules, with the step's ``StepBias`` after the usual arguments."""

    # ``bias`` is always passed: its default only keeps EncoderLayer's signature.
    def forward(
        self,
        x: torch.Tensor,
        inputs: StepInputs,
        post,
        kernel: str,
        bias: StepBias | None = None,
    ) -> torch.Tensor:
        return post(self.cfg, x, self._attend(x, inputs.attn, bias), self.ffn_weights())

    def forward_fused(
        self, x: torch.Tensor, inputs: StepInputs, bias: StepBias | None = None
    ) -> torch.Tensor:
        a = self._attend(x, inputs.attn, bias)
        return bert.post_attention_fused(self.cfg, x, a, self.packed_ffn_weights())

    def _attend(
        self, x: torch.Tensor, meta: AttentionMetadata, bias: StepBias | None
    ) -> torch.Tensor:
        assert bias is not None, "a biased layer needs the step's bias"
        h, d = self.num_heads, self.head_dim
        if isinstance(bias, BiasedAttentionPlan):
            a = biased_attention(self.qkv_proj(x), bias, h, d, scale=self.scale)
        else:
            a = biased_varlen_attention(self.qkv_proj(x), meta, bias, h, d, scale=self.scale)
        return a.view(-1, h, d)  # [T, H, D]


class RelativeEncoderStage(EncoderStage):
    """A stage of DistilBERT, ELECTRA or MPNet, with ``EncoderStage``'s contract (and its CPU
    tiling and fused paths): token ids in on the first stage, hidden states out; MPNet's
    attention adds its relative position bias in the Triton kernel where the deployment runs
    it (CUDA graphs too), else in T5's padded groups (never flash, nor CUDA graphs).
    """

    def __init__(
        self,
        cfg: RelativeConfig,
        layers: range,
        first: bool,
        last: bool,
        max_len: int,
        head: ClassifierHead | None = None,
    ):
        # Not EncoderStage.__init__: that builds BERT's embeddings; this builds its own.
        block = cfg.block
        self._init_body(block, layers, first, last)  # EncoderStage's methods read cfg: the block
        self.embed = embed  # its own embeddings (or their torch.compile'd graph)
        self.relative = cfg
        h, e = block.hidden_size, cfg.embedding_size
        if first:
            self.word_embeddings = embedding(block.vocab_size, e)
            self.position_embeddings = embedding(block.max_positions + block.position_offset, e)
            self.token_type_embeddings = (
                embedding(block.type_vocab_size, e) if cfg.token_types else None
            )
            self.emb_norm = nn.LayerNorm(e, eps=block.layer_norm_eps)
            self.emb_project = nn.Linear(e, h) if e != h else None
        layer = BiasedEncoderLayer if cfg.relative_buckets else EncoderLayer
        self.graph_safe = not cfg.relative_buckets
        self.layers = nn.ModuleDict({str(i): layer(block) for i in layers})
        if cfg.relative_buckets:
            self.relative_attention_bias = RelativePositionBias(
                _MPNET_BUCKETS, _MPNET_MAX_DISTANCE, block.num_heads, rows=cfg.relative_buckets
            )
        if last and head is not None:
            self.score_head = build_score_head(head, h, block.vocab_size)

    @classmethod
    def honours_key_lengths(cls, cfg: Any) -> bool:
        # DistilBERT and ELECTRA attend through attend(); MPNet's biased attention does not.
        return not cfg.relative_buckets

    @classmethod
    def supports_int8(cls, cfg: Any) -> bool:
        return not cfg.relative_buckets  # MPNet's layers project q|k|v in their own attention

    def reset_buffers(self) -> None:
        if self.relative.relative_buckets:
            self.relative_attention_bias.reset_buffers()

    def graph_safe_with(self, kernel: str) -> bool:
        return self.graph_safe or kernel == "triton"

    def _forward_rows(self, x: torch.Tensor, inputs: StepInputs, fused: bool = False):
        block = self.cfg
        if self.is_first:
            project, position = self.emb_project, self.position_embeddings
            token_type = self.token_type_embeddings
            assert position is not None  # each of these families has a position table
            x = self.embed(
                x, inputs.positions + block.position_offset, inputs.token_type_ids,
                self.word_embeddings.weight, position.weight,
                token_type.weight if token_type is not None else None,
                self.emb_norm.weight, self.emb_norm.bias, block.layer_norm_eps,
                project.weight if project is not None else None,
                project.bias if project is not None else None,
            )  # fmt: skip
        bias: tuple[StepBias, ...] = ()  # the biased layers' extra argument, if any
        if self.relative.relative_buckets:  # one per step (or CPU tile), shared by the layers
            table = self.relative_attention_bias
            if self.attn_kernel == "triton":
                bias = (table.by_distance(),)
            else:
                exact = x.device.type == "cpu"  # CPU steps come sorted by length: no padding
                bias = (BiasedAttentionPlan.build(inputs.attn.cu_q_host, table, exact=exact),)
        # BiasedEncoderLayers where the stage has the bias; plain EncoderLayers (no bias) where not.
        for layer in cast("Iterable[EncoderLayer]", self.layers.values()):
            between_layers()
            if self.int8:
                x = layer.forward_int8(x, inputs)
            elif fused:
                x = layer.forward_fused(x, inputs, *bias)
            else:
                x = layer(x, inputs, self.post, self.attn_kernel, *bias)
        return x

    def set_compiled(self, on: bool) -> None:
        self.post = (
            compile_layer_fn(post_attention, round_like_eager=False) if on else post_attention
        )
        self.embed = compile_layer_fn(embed, round_like_eager=False) if on else embed

    def weight_specs(self) -> list[WeightSpec]:
        cfg, block, names = self.relative, self.cfg, self.relative.names
        h, e, inter = block.hidden_size, cfg.embedding_size, block.intermediate_size
        specs: list[WeightSpec] = []
        if self.is_first:
            tables = [
                ("word_embeddings", block.vocab_size),
                ("position_embeddings", block.max_positions + block.position_offset),
            ]
            if cfg.token_types:
                tables.append(("token_type_embeddings", block.type_vocab_size))
            specs += [
                WeightSpec(f"embeddings.{name}.weight", (rows, e), f"{name}.weight")
                for name, rows in tables
            ]
            specs += norm_specs("embeddings.LayerNorm", "emb_norm", e)
            if e != h:
                specs += linear_specs("embeddings_project", "emb_project", h, e, True)
        if cfg.relative_buckets:  # every stage: each layer adds the bias
            shape = (cfg.relative_buckets, block.num_heads)
            name = "relative_attention_bias.weight"
            specs.append(WeightSpec(f"encoder.{name}", shape, name))
        for i in self.layer_range:
            c, p = f"{names.layers}.{i}", f"layers.{i}"
            for j, name in enumerate((names.q, names.k, names.v)):
                specs += linear_specs(
                    f"{c}.{name}", f"{p}.qkv_proj", h, h, True, (j * h, (j + 1) * h)
                )
            specs += linear_specs(f"{c}.{names.attn_out}", f"{p}.attn_out", h, h, True)
            specs += norm_specs(f"{c}.{names.attn_norm}", f"{p}.attn_norm", h)
            specs += linear_specs(f"{c}.{names.ffn_in}", f"{p}.ffn_in", inter, h, True)
            specs += linear_specs(f"{c}.{names.ffn_out}", f"{p}.ffn_out", h, inter, True)
            specs += norm_specs(f"{c}.{names.ffn_norm}", f"{p}.ffn_norm", h)
        return specs + self.head_specs()
