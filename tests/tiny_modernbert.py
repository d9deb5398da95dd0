"""Tiny ModernBERT checkpoints written by ``transformers`` (random weights, real switches), with
the bert-base-uncased WordPiece tokenizer all-MiniLM-L6-v2 ships, so that the special-token
ids in the config ([CLS] 101, [SEP] 102, [PAD] 0) are the tokenizer's."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny_models import _copy_minilm_tokenizer

# Three layers: 0 and 2 global, 1 local, with a window (8 tokens either side) that the long
# prompts (150+ tokens) really cut.
TINY_MODERNBERT = dict(
    vocab_size=30522,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    global_attn_every_n_layers=2,
    local_attention=16,
    global_rope_theta=160000.0,
    local_rope_theta=10000.0,
    max_position_embeddings=1024,
    pad_token_id=0,
    bos_token_id=101,
    cls_token_id=101,
    eos_token_id=102,
    sep_token_id=102,
    initializer_range=0.1,  # attention far from uniform
)


def make_modernbert(path: Path, *, legacy_config: bool = True, seed: int = 0, **fields) -> Path:
    """A ModernBertModel. ``legacy_config``: config.json as the hub's checkpoints have it
    (gte-modernbert-base: ``global_attn_every_n_layers`` and ``*_rope_theta``, no
    ``layer_types`` or ``rope_parameters``); else as transformers 5.17 writes it."""
    import transformers

    _copy_minilm_tokenizer(path)
    config = transformers.ModernBertConfig(**{**TINY_MODERNBERT, **fields})
    torch.manual_seed(seed)
    transformers.ModernBertModel(config).eval().save_pretrained(str(path))
    if legacy_config:
        _to_legacy_config(path)
    return path


def make_modernbert_masked_lm(path: Path, *, seed: int = 0) -> Path:
    """A ModernBertForMaskedLM (prefixed encoder weights, plus head and decoder)."""
    import transformers

    _copy_minilm_tokenizer(path)
    config = transformers.ModernBertConfig(**TINY_MODERNBERT)
    torch.manual_seed(seed)
    transformers.ModernBertForMaskedLM(config).eval().save_pretrained(str(path))
    return path


def make_modernbert_classifier(path: Path, *, seed: int = 0, **fields) -> Path:
    """gte-reranker-modernbert-base's kind of checkpoint (ModernBertForSequenceClassification,
    one label), with every bias switched on so that each bias is loaded and used."""
    import transformers

    _copy_minilm_tokenizer(path)
    config = transformers.ModernBertConfig(
        **{
            **TINY_MODERNBERT,
            "attention_bias": True,
            "mlp_bias": True,
            "norm_bias": True,
            "classifier_bias": True,
            "classifier_activation": "gelu",
            "num_labels": 1,
            "architectures": ["ModernBertForSequenceClassification"],
            **fields,
        }
    )
    torch.manual_seed(seed)
    model = transformers.ModernBertForSequenceClassification(config).eval()
    with torch.no_grad():  # transformers initialises biases to zero; make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
        model.classifier.weight.mul_(10.0)  # scores spread well beyond the 1e-4 tolerance
    model.save_pretrained(str(path))
    return path


def make_st_modernbert(path: Path) -> Path:
    """A sentence-transformers folder: tiny ModernBERT + mean pooling + Normalize (the modules
    of gte-modernbert-base's and modernbert-embed-base's folders, with their pooling)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    encoder = make_modernbert(path.with_name(path.name + "-transformer"))
    st = SentenceTransformer(
        modules=[
            modules.Transformer(str(encoder), max_seq_length=512),
            modules.Pooling(64, pooling_mode="mean"),
            modules.Normalize(),
        ],
        device="cpu",
    )
    st.save(str(path))
    return path


def _to_legacy_config(path: Path) -> None:
    data = json.loads((path / "config.json").read_text())
    data.pop("layer_types")
    rope = data.pop("rope_parameters")
    data["global_rope_theta"] = rope["full_attention"]["rope_theta"]
    data["local_rope_theta"] = rope["sliding_attention"]["rope_theta"]
    data["global_attn_every_n_layers"] = TINY_MODERNBERT["global_attn_every_n_layers"]
    (path / "config.json").write_text(json.dumps(data, indent=2))
