"""DeBERTa-v2 / v3 (mxbai-rerank-base-v1, deberta-v3 classifiers), as transformers 5.17's
``modeling_deberta_v2.py`` computes it.

Embeddings: word (+ absolute positions where ``position_biased_input``) (+ token types where
``type_vocab_size`` > 0), ``embed_proj`` (no bias) where ``embedding_size`` differs from the
hidden size, then LayerNorm. Layers: BERT's post-norm block (models/bert.py), with
disentangled self-attention (layers/disentangled_attention.py): content-to-content scores plus
the c2p and/or p2c terms that ``pos_att_type`` names, read from ``encoder.rel_embeddings``
(LayerNorm'ed where ``norm_rel_ebd`` says ``layer_norm``) through each layer's own position
projections (``pos_key_proj`` / ``pos_query_proj``, or its key / query projections where
``share_att_key``), at relative distances log-bucketed into ``position_buckets``; the scale is
1 / sqrt(head_dim * (1 + number of terms)). Every stage holds the relative embeddings (each
layer reads them). ``conv_kernel_size`` > 0 (a ConvLayer after the first layer) is refused.

Like every encoder, a prompt is never chunked and no KV cache is kept."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..core.classifier_head import ClassifierHead
from ..errors import ModelLoadError
from ..layers.activation import get_activation
from ..layers.disentangled_attention import (
    PositionTerms,
    RelativeIndex,
    disentangled_attention,
    relative_index_tables,
)
from . import bert
from .base import StepInputs, WeightSpec, compile_layer_fn, embedding, linear_specs
from .bert import EncoderConfig, EncoderLayer, EncoderStage, norm_specs, post_attention
from .between_layers import between_layers
from .score_heads import DebertaClassifier, build_score_head

POS_ATT_TYPES = ("c2p", "p2c")


def pos_att_types(value: Any) -> list[str]:
    """``pos_att_type`` as transformers reads it: a list, or a "p2c|c2p" string."""
    if value is None:
        return []
    if isinstance(value, str):
        return [x.strip() for x in value.lower().split("|")]
    return list(value)


def norm_rel_ebd(value: Any) -> list[str]:
    """``norm_rel_ebd`` as transformers reads it ("layer_norm", "none" or a "|" list)."""
    return [x.strip() for x in str(value if value is not None else "none").lower().split("|")]


@dataclass(frozen=True)
class DebertaConfig:
    """What a DeBERTa-v2 config.json says the encoder computes (transformers' defaults where a
    field is absent)."""

    block: EncoderConfig  # vocabulary, absolute positions, token types and BERT's block
    embedding_size: int
    position_biased_input: bool  # add absolute position embeddings
    relative_attention: bool
    c2p: bool
    p2c: bool
    share_att_key: bool  # position projections are the layer's own key / query projections
    position_buckets: int  # > 0: distances log-bucketed into this many per direction
    max_relative_positions: int
    norm_rel_ebd: bool  # LayerNorm on the relative embeddings
    pooler_act: str

    @property
    def span(self) -> int:
        """Half the rows of the relative embedding table."""
        return self.position_buckets if self.position_buckets > 0 else self.max_relative_positions

    @property
    def scale_factor(self) -> int:
        # transformers counts the terms in pos_att_type whether or not relative_attention is on.
        return 1 + self.c2p + self.p2c

    @classmethod
    def from_hf(cls, hf: dict, family: str = "deberta", *, causal: bool = False) -> DebertaConfig:
        assert not causal, "DeBERTa is an encoder"
        hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        if hf.get("attention_head_size") not in (None, hidden // heads):
            _refuse("attention_head_size", hf["attention_head_size"], "heads of another size")
        if hf.get("pooler_hidden_size") not in (None, hidden):
            _refuse("pooler_hidden_size", hf["pooler_hidden_size"], "a pooler of another width")
        for name in ("hidden_act", "pooler_hidden_act"):
            get_activation(hf.get(name, "gelu"))  # fail at load time, not mid-request
        types = pos_att_types(hf.get("pos_att_type"))
        if any(t not in POS_ATT_TYPES for t in types):
            _refuse("pos_att_type", hf["pos_att_type"], "terms other than c2p and p2c")
        max_positions = int(hf.get("max_position_embeddings", 512))
        max_relative = int(hf.get("max_relative_positions", -1))
        block = EncoderConfig(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            max_positions=max_positions,
            type_vocab_size=int(hf.get("type_vocab_size", 0)),
            layer_norm_eps=float(hf.get("layer_norm_eps", 1e-7)),
            hidden_act=hf.get("hidden_act", "gelu"),
            position_offset=0,
        )
        return cls(
            block=block,
            embedding_size=int(hf.get("embedding_size") or hidden),
            position_biased_input=bool(hf.get("position_biased_input", True)),
            relative_attention=bool(hf.get("relative_attention", False)),
            c2p="c2p" in types,
            p2c="p2c" in types,
            share_att_key=bool(hf.get("share_att_key", False)),
            position_buckets=int(hf.get("position_buckets", -1)),
            max_relative_positions=max_relative if max_relative >= 1 else max_positions,
            norm_rel_ebd="layer_norm" in norm_rel_ebd(hf.get("norm_rel_ebd")),
            pooler_act=hf.get("pooler_hidden_act", "gelu"),
        )


def _refuse(field: str, value: Any, what: str) -> None:
    raise ModelLoadError(
        f"config.json sets {field}={value!r} ({what}), which the deberta family in pipepool "
        "does not implement; refusing rather than computing other math"
    )


def embed(
    ids: torch.Tensor,
    positions: torch.Tensor,
    types: torch.Tensor | None,
    word: torch.Tensor,
    position: torch.Tensor | None,
    token_type: torch.Tensor | None,
    project: torch.Tensor | None,
    norm: torch.Tensor,
    norm_bias: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """norm(project(word[ids] (+ position[positions]) (+ token_type[types]))): each table only
    where the checkpoint has it; ``types`` None is type 0 throughout (single texts)."""
    x = F.embedding(ids, word)
    if position is not None:
        x = x + F.embedding(positions, position)
    if token_type is not None:
        x = x + (F.embedding(types, token_type) if types is not None else token_type[0])
    if project is not None:
        x = F.linear(x, project)
    return F.layer_norm(x, (x.shape[-1],), norm, norm_bias, eps)


class RelativeContext(NamedTuple):
    """What every layer of a stage reads for one step (or CPU tile): the relative embeddings
    (normed where the checkpoint says) [2S, hidden] and the step's table-row indices."""

    embeddings: torch.Tensor
    rows: RelativeIndex  # not ``index``: that would shadow tuple.index


class DisentangledLayer(EncoderLayer):
    """``EncoderLayer`` (BERT's post-norm block, fused q|k|v) whose attention is DeBERTa's:
    the same modules plus this layer's position projections, with the step's
    ``RelativeContext`` (None without relative attention) after the usual arguments."""

    def __init__(self, cfg: DebertaConfig) -> None:
        super().__init__(cfg.block)
        self.deberta = cfg
        h = cfg.block.hidden_size
        own = cfg.relative_attention and not cfg.share_att_key
        self.pos_key_proj = nn.Linear(h, h) if own and cfg.c2p else None
        self.pos_query_proj = nn.Linear(h, h) if own and cfg.p2c else None

    # ``rel`` is always passed (None: no relative attention); the default only keeps
    # EncoderLayer's signature.
    def forward(
        self,
        x: torch.Tensor,
        inputs: StepInputs,
        post,
        kernel: str,
        rel: RelativeContext | None = None,
    ) -> torch.Tensor:
        return post(self.cfg, x, self._attend(x, inputs, rel), self.ffn_weights())

    def forward_fused(
        self, x: torch.Tensor, inputs: StepInputs, rel: RelativeContext | None = None
    ) -> torch.Tensor:
        a = self._attend(x, inputs, rel)
        return bert.post_attention_fused(self.cfg, x, a, self.packed_ffn_weights())

    def _attend(
        self, x: torch.Tensor, inputs: StepInputs, rel: RelativeContext | None
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).view(-1, 3 * self.num_heads, self.head_dim).chunk(3, dim=1)
        terms = self._position_terms(rel) if rel is not None else None
        return disentangled_attention(
            q, k, v, inputs.attn, terms, scale_factor=self.deberta.scale_factor
        )  # [T, H, D]

    def _position_terms(self, rel: RelativeContext) -> PositionTerms:
        cfg, e = self.deberta, rel.embeddings

        def heads(y: torch.Tensor) -> torch.Tensor:  # [2S, H*D] -> [H, 2S, D]
            return y.view(y.shape[0], self.num_heads, self.head_dim).transpose(0, 1)

        if cfg.share_att_key:  # transformers projects with query_proj and key_proj (biases too)
            pos_query, pos_key, _ = self.qkv_proj(e).chunk(3, dim=1)
        else:
            pos_key = self.pos_key_proj(e) if self.pos_key_proj is not None else None
            pos_query = self.pos_query_proj(e) if self.pos_query_proj is not None else None
        return PositionTerms(
            heads(pos_key) if cfg.c2p else None,
            heads(pos_query) if cfg.p2c else None,
            rel.rows,
        )


class DebertaStage(EncoderStage):
    """A slice of a DeBERTa-v2 encoder's layers, with ``EncoderStage``'s contract (and its CPU
    tiling and fused paths): token ids in on the first stage, hidden states [T, hidden] out;
    the last stage carries a ``*ForSequenceClassification`` head. Attention runs its own
    kernel (never the Triton/flash ones, nor in CUDA graphs)."""

    graph_safe = False  # disentangled attention reads the step's host offsets

    @classmethod
    def supports_int8(cls, cfg: Any) -> bool:
        return False  # its layers attend with position terms of their own

    @classmethod
    def honours_key_lengths(cls, cfg: Any) -> bool:
        return False  # disentangled attention keys every token of a prompt

    # Buffers, with relative attention (see __init__).
    c2p_rows: torch.Tensor
    p2c_rows: torch.Tensor

    def __init__(
        self,
        cfg: DebertaConfig,
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
        self.deberta = cfg
        h, e = block.hidden_size, cfg.embedding_size
        if first:
            self.word_embeddings = embedding(block.vocab_size, e)
            self.position_embeddings = (
                embedding(block.max_positions, e) if cfg.position_biased_input else None
            )
            self.token_type_embeddings = (
                embedding(block.type_vocab_size, e) if block.type_vocab_size > 0 else None
            )
            self.embed_proj = nn.Linear(e, h, bias=False) if e != h else None
            self.emb_norm = nn.LayerNorm(h, eps=block.layer_norm_eps)
        self.layers = nn.ModuleDict({str(i): DisentangledLayer(cfg) for i in layers})
        if cfg.relative_attention:  # every stage: each layer reads them
            self.rel_embeddings = embedding(2 * cfg.span, h)
            self.rel_norm = nn.LayerNorm(h, eps=block.layer_norm_eps) if cfg.norm_rel_ebd else None
            # The table rows of the c2p and p2c terms by query-minus-key distance d, at index
            # d + max_positions - 1.
            distances = 2 * block.max_positions - 1
            for name in ("c2p_rows", "p2c_rows"):
                self.register_buffer(
                    name, torch.empty(distances, dtype=torch.long), persistent=False
                )
        if last and head is not None and head.per_token:
            self.score_head = build_score_head(head, h, block.vocab_size)
        elif last and head is not None:
            self.score_head = DebertaClassifier(h, head.num_labels, activation=cfg.pooler_act)

    def reset_buffers(self) -> None:
        cfg = self.deberta
        if cfg.relative_attention:
            # On the CPU, as transformers computes its buckets: a distance on a bucket boundary
            # rounds the same way on every device.
            c2p, p2c = relative_index_tables(
                self.max_positions, cfg.span, cfg.position_buckets, cfg.max_relative_positions
            )
            self.c2p_rows = c2p.to(self.c2p_rows.device)
            self.p2c_rows = p2c.to(self.p2c_rows.device)

    def attention_block_rows(self) -> int | None:
        return None

    def _relative_context(self) -> RelativeContext | None:
        if not self.deberta.relative_attention:
            return None
        e = self.rel_embeddings.weight
        if self.rel_norm is not None:
            norm = self.rel_norm
            e = F.layer_norm(e, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
        return RelativeContext(e, RelativeIndex(self.c2p_rows, self.p2c_rows))

    def _forward_rows(
        self, x: torch.Tensor, inputs: StepInputs, fused: bool = False
    ) -> torch.Tensor:
        block = self.cfg
        if self.is_first:
            position, token_type = self.position_embeddings, self.token_type_embeddings
            x = self.embed(
                x, inputs.positions, inputs.token_type_ids, self.word_embeddings.weight,
                position.weight if position is not None else None,
                token_type.weight if token_type is not None else None,
                self.embed_proj.weight if self.embed_proj is not None else None,
                self.emb_norm.weight, self.emb_norm.bias, block.layer_norm_eps,
            )  # fmt: skip
        rel = self._relative_context()  # one per step (or CPU tile), shared by the layers
        for layer in cast("Iterable[DisentangledLayer]", self.layers.values()):
            between_layers()
            if fused:
                x = layer.forward_fused(x, inputs, rel)
            else:
                x = layer(x, inputs, self.post, self.attn_kernel, rel)
        return x

    def set_compiled(self, on: bool) -> None:
        self.post = (
            compile_layer_fn(post_attention, round_like_eager=False) if on else post_attention
        )
        self.embed = compile_layer_fn(embed, round_like_eager=False) if on else embed

    def weight_specs(self) -> list[WeightSpec]:
        cfg, block = self.deberta, self.cfg
        h, e, inter = block.hidden_size, cfg.embedding_size, block.intermediate_size
        specs: list[WeightSpec] = []
        if self.is_first:
            tables = [("word_embeddings", block.vocab_size)]
            if cfg.position_biased_input:
                tables.append(("position_embeddings", block.max_positions))
            if block.type_vocab_size > 0:
                tables.append(("token_type_embeddings", block.type_vocab_size))
            specs += [
                WeightSpec(f"embeddings.{name}.weight", (rows, e), f"{name}.weight")
                for name, rows in tables
            ]
            if e != h:
                specs += linear_specs("embeddings.embed_proj", "embed_proj", h, e, False)
            specs += norm_specs("embeddings.LayerNorm", "emb_norm", h)
        if cfg.relative_attention:
            name, shape = "rel_embeddings.weight", (2 * cfg.span, h)
            specs.append(WeightSpec(f"encoder.{name}", shape, name))
            if cfg.norm_rel_ebd:
                specs += norm_specs("encoder.LayerNorm", "rel_norm", h)
        for i in self.layer_range:
            c, p = f"encoder.layer.{i}", f"layers.{i}"
            for j, name in enumerate(("query_proj", "key_proj", "value_proj")):
                specs += linear_specs(
                    f"{c}.attention.self.{name}", f"{p}.qkv_proj", h, h, True, (j * h, (j + 1) * h)
                )
            for name in ("pos_key_proj", "pos_query_proj"):
                if getattr(self.layers[str(i)], name) is not None:
                    specs += linear_specs(f"{c}.attention.self.{name}", f"{p}.{name}", h, h, True)
            specs += linear_specs(f"{c}.attention.output.dense", f"{p}.attn_out", h, h, True)
            specs += norm_specs(f"{c}.attention.output.LayerNorm", f"{p}.attn_norm", h)
            specs += linear_specs(f"{c}.intermediate.dense", f"{p}.ffn_in", inter, h, True)
            specs += linear_specs(f"{c}.output.dense", f"{p}.ffn_out", h, inter, True)
            specs += norm_specs(f"{c}.output.LayerNorm", f"{p}.ffn_norm", h)
        return specs + self.head_specs()
