"""Tiny DeBERTa-v2 checkpoints with random weights, written by ``transformers`` from
deberta-v3's config (shrunk), with the all-MiniLM WordPiece tokenizer: its [PAD] is 0 as in
DeBERTa's vocabulary, and its pairs are [CLS] a [SEP] b [SEP] with b of token type 1, as
DeBERTa-v3's SentencePiece tokenizer forms them.

Relative positions are bucketed into few buckets reaching a short distance (8 buckets per
direction up to 64), so that on the 150+ token prompts of ``long_prompts()`` most distances
are log-bucketed and many clamp at the table's edge."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import _copy_minilm_tokenizer

PAD = 0
_SHAPE = dict(
    vocab_size=30522,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    initializer_range=0.1,
    max_position_embeddings=512,
    relative_attention=True,
    pos_att_type=["p2c", "c2p"],
    position_buckets=8,
    max_relative_positions=64,
    layer_norm_eps=1e-7,
    pad_token_id=PAD,
)

# deberta-v2-xlarge's switches: absolute positions too, own position projections, no norm on
# the relative embeddings; here with narrower embeddings projected up (embed_proj).
V2_EMBEDDER = dict(
    position_biased_input=True,
    share_att_key=False,
    norm_rel_ebd="none",
    type_vocab_size=0,
    embedding_size=32,
)
# deberta-v3 / mxbai-rerank-base-v1's switches: relative positions only, the position terms
# through the layer's own query / key projections, LayerNorm on the relative embeddings; with
# two token types (the real ones have none) so that a pair's types are read.
V3_CLASSIFIER = dict(
    position_biased_input=False,
    share_att_key=True,
    norm_rel_ebd="layer_norm",
    type_vocab_size=2,
    pooler_hidden_act="gelu",
)


def make_deberta(
    path: Path,
    architecture: str = "DebertaV2Model",
    *,
    num_labels: int = 1,
    seed: int = 0,
    **config_fields,
) -> Path:
    """A tiny DeBERTa-v2 as ``architecture`` (``DebertaV2Model``, ``DebertaV2ForMaskedLM`` or
    ``DebertaV2ForSequenceClassification`` of ``num_labels`` labels); ``config_fields`` (e.g.
    ``V2_EMBEDDER``) are set in its config. The relative embeddings are drawn with unit
    variance, so that a position term computed wrongly shows."""
    import transformers

    _copy_minilm_tokenizer(path)
    labels = {}
    if architecture.endswith("SequenceClassification"):
        labels = dict(
            num_labels=num_labels,
            id2label={i: f"class-{i}" for i in range(num_labels)},
            label2id={f"class-{i}": i for i in range(num_labels)},
        )
    config = transformers.DebertaV2Config(
        **{**_SHAPE, **config_fields}, architectures=[architecture], **labels
    )
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).eval()
    encoder = model.encoder if architecture == "DebertaV2Model" else model.deberta.encoder
    if config.relative_attention:
        with torch.no_grad():
            encoder.rel_embeddings.weight.normal_(0.0, 1.0)
    model.save_pretrained(str(path))
    return path
