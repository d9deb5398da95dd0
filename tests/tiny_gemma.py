"""Tiny Gemma checkpoints with random weights, written by ``transformers`` from the real
families' configs (shrunk): Gemma2 (bge-multilingual-gemma2's family, soft-capped attention),
Gemma3 text causal (Gemma3ForCausalLM) and bidirectional (EmbeddingGemma), and an
EmbeddingGemma-shaped sentence-transformers folder; plus their transformers references."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny_models import Reference, _train_bpe

# hidden 64, 4 query heads over 2 KV heads; a query scale other than head_dim ** -0.5 and a
# window far shorter than the long prompts, so both change the vectors.
_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    initializer_range=0.1,
    query_pre_attn_scalar=24,
    sliding_window=16,
)
LAYER_TYPES = ["sliding_attention", "full_attention"] * 2  # each PP=2 stage gets both kinds
# Small enough that capping changes the scores of these weights (real checkpoints: 50).
SOFTCAP = 1.0
EMBEDDINGGEMMA_PROMPTS = {
    "query": "task: search result | query: ",
    "document": "title: none | text: ",
}


def _tokenizer(path: Path) -> dict:
    """Gemma's tokenizer prepends <bos> and has a <pad> (sentence-transformers pads batches);
    the config's vocabulary size and special token ids."""
    from tokenizers import Tokenizer

    _train_bpe(path, bos="<bos>", eos="<eos>")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(["<pad>"])
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": "<pad>"}))
    # No prompt holds <pad>: transformers' classifier reads the last token that is not one.
    return dict(
        vocab_size=tok.get_vocab_size() + 1,
        bos_token_id=tok.token_to_id("<bos>"),
        eos_token_id=tok.token_to_id("<eos>"),
        pad_token_id=tok.token_to_id("<pad>"),
    )


def _save(model, path: Path, seed: int) -> Path:
    # Gemma's norms start at zero (a scale of 1 + 0); random ones exercise the 1 + w.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    model.eval().save_pretrained(str(path))
    return path


def _labels(num_labels: int | None) -> dict:
    if num_labels is None:
        return {}
    return dict(
        num_labels=num_labels,
        id2label={i: f"class-{i}" for i in range(num_labels)},
        label2id={f"class-{i}": i for i in range(num_labels)},
    )


def make_gemma2(
    path: Path,
    *,
    num_layers: int = 2,
    seed: int = 0,
    num_labels: int | None = None,
    softcap: float | None = SOFTCAP,
    **shape,
) -> Path:
    """Gemma2 (soft-capped attention unless ``softcap`` is None, alternating sliding layers);
    ``num_labels``: a Gemma2ForSequenceClassification with that many labels, else a
    Gemma2Model; ``shape``: other sizes."""
    import transformers

    config = transformers.Gemma2Config(
        num_hidden_layers=num_layers,
        layer_types=LAYER_TYPES[:num_layers],
        attn_logit_softcapping=softcap,
        final_logit_softcapping=30.0,
        **{**_TINY, **shape},
        **_tokenizer(path),
        **_labels(num_labels),
    )
    torch.manual_seed(seed)
    cls = transformers.Gemma2ForSequenceClassification if num_labels else transformers.Gemma2Model
    return _save(cls(config), path, seed)


def make_gemma3(
    path: Path,
    *,
    bidirectional: bool,
    num_layers: int = 2,
    seed: int = 0,
    num_labels: int | None = None,
    **shape,
) -> Path:
    """Gemma3 text: causal as Gemma3ForCausalLM (with gemma-3-4b's linear RoPE scaling on the
    global layers), or bidirectional as EmbeddingGemma's Gemma3TextModel; ``num_labels``: a
    Gemma3TextForSequenceClassification with that many labels; ``shape``: other sizes."""
    import transformers

    rope = {
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    }
    if not bidirectional:
        rope["full_attention"] = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    config = transformers.Gemma3TextConfig(
        num_hidden_layers=num_layers,
        layer_types=LAYER_TYPES[:num_layers],
        rope_parameters=rope,
        use_bidirectional_attention=bidirectional,
        **{**_TINY, **shape},
        **_tokenizer(path),
        **_labels(num_labels),
    )
    torch.manual_seed(seed)
    model_cls = transformers.Gemma3TextModel if bidirectional else transformers.Gemma3ForCausalLM
    if num_labels:
        model_cls = transformers.Gemma3TextForSequenceClassification
    return _save(model_cls(config), path, seed)


def make_embeddinggemma_st(path: Path) -> Path:
    """EmbeddingGemma-300m's sentence-transformers folder, shrunk: bidirectional Gemma3 text +
    mean pooling + Dense(64->256) + Dense(256->64) (Identity, no bias) + Normalize, with its
    query / document prompts."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    transformer = make_gemma3(path.with_name(path.name + "-transformer"), bidirectional=True)
    torch.manual_seed(1)
    modules = [
        models.Transformer(str(transformer), max_seq_length=2048),
        models.Pooling(64, pooling_mode="mean"),
        models.Dense(64, 256, bias=False, activation_function=torch.nn.Identity()),
        models.Dense(256, 64, bias=False, activation_function=torch.nn.Identity()),
        models.Normalize(),
    ]
    st = SentenceTransformer(modules=modules, device="cpu", prompts=EMBEDDINGGEMMA_PROMPTS)
    st.save(str(path))
    return path


def gemma_reference(path: Path) -> Reference:
    """transformers on the folder with its eager attention: the implementation that computes
    everything a Gemma config asks for (5.17's sdpa path drops attn_logit_softcapping)."""
    import transformers

    ref = Reference(path)
    ref.model = transformers.AutoModel.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return ref
