"""Tiny DistilBERT, ELECTRA and MPNet checkpoints with random weights, written by
``transformers`` from the real models' configs (shrunk), with the all-MiniLM WordPiece
tokenizer: bert-base-uncased's vocabulary, which msmarco-distilbert and ms-marco-electra ship;
MPNet's own tokenizer is WordPiece too, so its config takes this one's special-token ids."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import _copy_minilm_tokenizer

# The MiniLM tokenizer's [PAD], [CLS] and [SEP].
PAD, CLS, SEP = 0, 101, 102
# Every tiny encoder's shape: an initialiser range larger than the default, so that attention
# is far from uniform.
_SHAPE = dict(
    vocab_size=30522,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    initializer_range=0.1,
)


def _labels(num_labels: int) -> dict:
    return {
        "num_labels": num_labels,
        "id2label": {i: f"class-{i}" for i in range(num_labels)},
        "label2id": {f"class-{i}": i for i in range(num_labels)},
    }


def make_distilbert(
    path: Path,
    architecture: str = "DistilBertModel",
    *,
    num_labels: int = 1,
    seed: int = 0,
    **config_fields,
) -> Path:
    """msmarco-distilbert-base-v4's config (learned positions, GELU), shrunk; as
    ``DistilBertModel``, ``DistilBertForMaskedLM`` or ``DistilBertForSequenceClassification``
    (a classifier of ``num_labels`` labels: one, a cross-encoder's). ``config_fields`` are
    set in its config as well."""
    import transformers

    _copy_minilm_tokenizer(path)
    config = transformers.DistilBertConfig(
        vocab_size=_SHAPE["vocab_size"],
        dim=_SHAPE["hidden_size"],
        hidden_dim=_SHAPE["intermediate_size"],
        n_layers=_SHAPE["num_hidden_layers"],
        n_heads=_SHAPE["num_attention_heads"],
        initializer_range=_SHAPE["initializer_range"],
        max_position_embeddings=512,
        activation="gelu",
        pad_token_id=PAD,
        architectures=[architecture],
        **(_labels(num_labels) if architecture.endswith("SequenceClassification") else {}),
        **config_fields,
    )
    torch.manual_seed(seed)
    getattr(transformers, architecture)(config).eval().save_pretrained(str(path))
    return path


def make_electra(
    path: Path, architecture: str = "ElectraModel", *, embedding_size: int = 32, seed: int = 0
) -> Path:
    """An ELECTRA discriminator's config, shrunk: embeddings narrower than the hidden states
    (``embeddings_project``, as electra-small), two token types. As
    ``ElectraForSequenceClassification`` it is cross-encoder/ms-marco-electra-base's shape: one
    label, pass ``embedding_size=64`` (no projection, as there)."""
    import transformers

    _copy_minilm_tokenizer(path)
    config = transformers.ElectraConfig(
        **_SHAPE,
        embedding_size=embedding_size,
        max_position_embeddings=512,
        type_vocab_size=2,
        pad_token_id=PAD,
        architectures=[architecture],
        **(_labels(1) if architecture.endswith("SequenceClassification") else {}),
    )
    torch.manual_seed(seed)
    getattr(transformers, architecture)(config).eval().save_pretrained(str(path))
    return path


def make_mpnet(
    path: Path, architecture: str = "MPNetForMaskedLM", *, seed: int = 0, **shape
) -> Path:
    """all-mpnet-base-v2's config (514 positions counted from 2, 32 relative-attention
    buckets, LayerNorm eps 1e-5), shrunk (``shape``: other sizes). The relative position bias
    table is drawn with unit variance (an initialiser range of 0.1 would leave it a small
    effect next to the scores), so that a bias added wrongly shows."""
    import transformers

    _copy_minilm_tokenizer(path)
    config = transformers.MPNetConfig(
        **{**_SHAPE, **shape},
        max_position_embeddings=514,
        relative_attention_num_buckets=32,
        layer_norm_eps=1e-5,
        pad_token_id=PAD,
        bos_token_id=CLS,
        eos_token_id=SEP,
        architectures=[architecture],
    )
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).eval()
    encoder = model.encoder if architecture == "MPNetModel" else model.mpnet.encoder
    with torch.no_grad():
        encoder.relative_attention_bias.weight.normal_(0.0, 1.0)
    model.save_pretrained(str(path))
    return path


def make_st_mpnet(path: Path) -> Path:
    """A sentence-transformers folder in all-mpnet-base-v2's layout: Transformer (MPNetModel,
    max_seq_length 384) + mean Pooling + Normalize."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    mpnet_dir = make_mpnet(path.with_name(path.name + "-transformer"), "MPNetModel", seed=2)
    modules = [
        models.Transformer(str(mpnet_dir), max_seq_length=384),
        models.Pooling(_SHAPE["hidden_size"], pooling_mode="mean"),
        models.Normalize(),
    ]
    SentenceTransformer(modules=modules, device="cpu").save(str(path))
    return path
