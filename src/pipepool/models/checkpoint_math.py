"""What math a checkpoint asks for, read from its config, and the refusal of anything the
families do not implement.

A checkpoint's config decides its math, never the family's habit: a decoder whose config says
``is_causal: false`` attends bidirectionally (as transformers runs it; Gemma3 reads
``use_bidirectional_attention`` instead), and a field that would change the math in a way no
family here computes is refused by name. Remote code named by
``auto_map`` is refused: pipepool would run its built-in family in its place, and that code may
compute something else (gte-Qwen2's ``Qwen2Model`` in its own ``modeling_qwen.py`` is
bidirectional while the built-in one is causal). The user may say which attention the remote
code uses (``EngineConfig.attention``): then the built-in family runs with it.

Torch-free: the driver decides once (``deployment.py``) and every stage is told the result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import ATTENTION
from ..core.dual_encoders import DUAL_ENCODERS
from ..errors import ModelLoadError

# The model_type each family's checkpoints carry (config.json), so that ``architectures[0]``
# alone never decides a family against what the config describes.
MODEL_TYPES = {
    "qwen3": ("qwen3",),
    "qwen2": ("qwen2",),
    "llama": ("llama",),
    "mistral": ("mistral",),
    "bert": ("bert",),
    "roberta": ("roberta", "xlm-roberta"),
    "distilbert": ("distilbert",),
    "electra": ("electra",),
    "mpnet": ("mpnet",),
    "modernbert": ("modernbert",),
    "gemma2": ("gemma2",),
    "gemma3": ("gemma3_text",),
    "t5": ("t5",),
    "deberta": ("deberta-v2",),
    "clip_text": ("clip",),
    "clip_vision": ("clip",),
    "siglip_text": ("siglip",),
    "siglip_vision": ("siglip",),
    "siglip2_text": ("siglip2",),
    "siglip2_vision": ("siglip2",),
    "qwen2_vl": ("qwen2_vl",),
    "qwen2_5_vl": ("qwen2_5_vl",),
    "qwen3_vl": ("qwen3_vl",),
    "colqwen2": ("colqwen2",),
    "colpali": ("colpali",),
}

# Decoders whose transformers implementation reads ``is_causal`` from the config (the mask is
# bidirectional when it is false). None of them reads ``use_bidirectional_attention``.
_READS_IS_CAUSAL = ("qwen3", "qwen2", "llama", "mistral")
# Decoders whose transformers implementation takes its direction from
# ``use_bidirectional_attention`` (true: every layer bidirectional, sliding layers a symmetric
# window), in its masks and its attention layers alike.
_READS_BIDIRECTIONAL = ("gemma3",)
# Why ``use_bidirectional_attention`` or ``is_causal: false`` cannot decide these families'
# direction: transformers reads them in some places and not in others, so what it computes
# depends on the attention implementation (eager or sdpa) and on the prompt's length.
_HALF_READ = {
    ("gemma2", "use_bidirectional_attention"): (
        "transformers' gemma2 reads it in its attention layers but builds causal masks"
    ),
    ("gemma2", "is_causal"): (
        "transformers' gemma2 builds bidirectional masks from it but its attention layers stay "
        "causal (they read use_bidirectional_attention)"
    ),
    ("gemma3", "is_causal"): (
        "transformers' gemma3 builds bidirectional masks from it but its attention layers read "
        "use_bidirectional_attention"
    ),
}

# auto_map keys that load model code (or a config class that may read fields differently).
_CODE_KEYS = ("AutoConfig", "AutoModel")


def _absent_or(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in allowed


def _falsy(value: Any) -> bool:
    return not value


# Config fields that change the math, by family, with the values this implementation computes.
# A checkpoint with any other value is refused by name rather than computed without it.
# The Qwen, Llama and Mistral families:
_DECODER_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "attn_logit_softcapping": (_absent_or(0, 0.0), "attention logit soft-capping"),
    "final_logit_softcapping": (_absent_or(0, 0.0), "final logit soft-capping"),
    "query_pre_attn_scalar": (_absent_or(), "a query scale other than head_dim ** -0.5"),
    "embedding_multiplier": (_absent_or(1, 1.0), "an embedding multiplier"),
    "residual_multiplier": (_absent_or(1, 1.0), "a residual multiplier"),
    "attention_multiplier": (_absent_or(), "an attention multiplier"),
    "use_qk_norm": (_falsy, "q/k norms on this family"),
    "no_rope_layers": (_falsy, "layers without RoPE"),
    "attention_chunk_size": (_absent_or(), "chunked attention"),
}
# Gemma computes attention soft-capping and its own query scale (models/gemma.py).
# final_logit_softcapping caps LM-head logits only, which no output here computes (pooled hidden
# states, score heads on them), so any value leaves the math unchanged.
_GEMMA2_FIELDS = {
    name: check
    for name, check in _DECODER_FIELDS.items()
    if name not in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar")
}
_GEMMA3_FIELDS = {
    **_GEMMA2_FIELDS,
    # transformers 5.17's Gemma3 reads the field but never passes it to its attention.
    "attn_logit_softcapping": (
        _absent_or(),
        "attention logit soft-capping, which transformers' gemma3 reads but never applies",
    ),
}
_ENCODER_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "is_decoder": (_falsy, "a causal (decoder) mask"),
    "is_causal": (lambda v: v is None or v is False, "a causal mask"),
    "use_bidirectional_attention": (lambda v: v is None or v is True, "a causal mask"),
    "add_cross_attention": (_falsy, "cross-attention"),
}


def _default_rope(value: Any) -> bool:
    """rope_parameters whose every layer type has the default rope_type."""
    return value is None or (
        isinstance(value, dict)
        and all((p or {}).get("rope_type", "default") == "default" for p in value.values())
    )


def _full_or_sliding(value: Any) -> bool:
    return value is None or (
        isinstance(value, list) and all(t in ("full_attention", "sliding_attention") for t in value)
    )


# ModernBERT reads its layer types, window and RoPE bases (models/modernbert.py); RoPE other
# than the default and attention types other than full and sliding are not computed.
_MODERNBERT_FIELDS = {
    **_ENCODER_FIELDS,
    "rope_scaling": (_absent_or(), "RoPE scaling"),
    "rope_parameters": (_default_rope, "a rope_type other than the default"),
    "layer_types": (_full_or_sliding, "attention other than full_attention and sliding_attention"),
}
# ELECTRA: transformers 5 computes absolute positions whatever the field says; a checkpoint
# trained with relative ones (older transformers) asked for other math.
_ELECTRA_FIELDS = {
    **_ENCODER_FIELDS,
    "position_embedding_type": (_absent_or("absolute"), "relative position embeddings"),
}
# MPNet: transformers buckets distances into 32 buckets whatever the table's size, so a smaller
# table cannot hold them.
_MPNET_FIELDS = {
    **_ENCODER_FIELDS,
    "relative_attention_num_buckets": (
        lambda v: v is None or (isinstance(v, int) and v >= 32),
        "a relative position bias table of fewer than the 32 buckets transformers reads",
    ),
}
# The T5 encoder (models/t5.py): a ReLU or gated-GELU feed-forward. T5Config derives
# dense_act_fn and is_gated_act from feed_forward_proj unless config.json sets them, so their
# combination is checked where the config is read (T5Config.from_hf).
_T5_FIELDS = {
    **_ENCODER_FIELDS,
    "feed_forward_proj": (
        _absent_or("relu", "gated-gelu"),
        "a feed-forward other than relu and gated-gelu",
    ),
    "dense_act_fn": (
        _absent_or("relu", "gelu_new"),
        "a feed-forward activation other than relu and gelu_new",
    ),
}


def _deberta_terms(value: Any) -> bool:
    """pos_att_type as transformers reads it (a list or a "p2c|c2p" string): c2p, p2c only."""
    if value is None:
        return True
    terms = value.lower().split("|") if isinstance(value, str) else value
    return isinstance(terms, list) and all(str(t).strip() in ("c2p", "p2c") for t in terms)


def _deberta_rel_norm(value: Any) -> bool:
    """norm_rel_ebd: transformers acts on "layer_norm" only; anything but it and "none" was
    meant to do something it does not."""
    return value is None or (
        isinstance(value, str)
        and all(t.strip() in ("none", "layer_norm") for t in value.lower().split("|"))
    )


# DeBERTa-v2 (models/deberta.py): the ConvLayer after the first layer is not implemented.
# attention_head_size and pooler_hidden_size are checked against the hidden size where the
# config is read (DebertaConfig.from_hf).
_DEBERTA_FIELDS = {
    **_ENCODER_FIELDS,
    "conv_kernel_size": (_falsy, "a convolution layer after the first layer (ConvLayer)"),
    "pos_att_type": (_deberta_terms, "relative attention terms other than c2p and p2c"),
    "norm_rel_ebd": (_deberta_rel_norm, "a relative-embedding norm other than layer_norm"),
}
# Dual encoders (models/towers.py) read their towers' sub-configs (TowerConfig.from_hf); at
# the top level only the direction of attention could matter, and transformers reads none.
_TOWER_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "is_causal": (_absent_or(), "an attention direction transformers' dual encoders ignore"),
    "use_bidirectional_attention": (
        _absent_or(),
        "an attention direction transformers' dual encoders ignore",
    ),
}
# Qwen2-VL and Qwen3-VL (models/qwen2_vl.py, qwen3_vl.py): causal as transformers computes
# them, whatever the config says.
_QWEN2_VL_FIELDS = {
    **_DECODER_FIELDS,
    "is_causal": (_absent_or(True), "an attention direction transformers' Qwen2-VL ignores"),
    "use_bidirectional_attention": (
        _absent_or(False),
        "an attention direction transformers' Qwen2-VL ignores",
    ),
}
# ColPali (models/colpali.py): bidirectional as transformers runs it on its processor's
# inputs; its top level holds no field of its math (vlm_config does, read by ColPaliConfig).
_COLPALI_FIELDS = {
    "is_causal": (_absent_or(False), "an attention direction transformers' ColPali ignores"),
    "use_bidirectional_attention": (
        _absent_or(True),
        "an attention direction transformers' ColPali ignores",
    ),
}
_TOWER_KINDS = DUAL_ENCODERS.values()
_FAMILY_FIELDS = {
    "qwen2_vl": _QWEN2_VL_FIELDS,
    "qwen2_5_vl": _QWEN2_VL_FIELDS,
    "qwen3_vl": _QWEN2_VL_FIELDS,
    "colqwen2": _QWEN2_VL_FIELDS,
    "colpali": _COLPALI_FIELDS,
    **{f"{kind}_{tower}": _TOWER_FIELDS for kind in _TOWER_KINDS for tower in ("text", "vision")},
    "gemma2": _GEMMA2_FIELDS,
    "gemma3": _GEMMA3_FIELDS,
    "modernbert": _MODERNBERT_FIELDS,
    "electra": _ELECTRA_FIELDS,
    "mpnet": _MPNET_FIELDS,
    "t5": _T5_FIELDS,
    "deberta": _DEBERTA_FIELDS,
}


def check_config(hf: dict, *, family: str, decoder: bool, architecture: str) -> None:
    """Refuse a config whose model_type contradicts its architecture, or that asks for math
    the family does not implement; the message names the field and its value."""
    model_type = hf.get("model_type")
    expected = MODEL_TYPES.get(family, ())
    if model_type is not None and model_type not in expected:
        raise ModelLoadError(
            f"config.json names architecture {architecture!r} (the {family} family) but "
            f"model_type {model_type!r}; pipepool runs only what both agree on "
            f"(model_type {' or '.join(map(repr, expected))})"
        )
    fields = _FAMILY_FIELDS.get(family, _DECODER_FIELDS if decoder else _ENCODER_FIELDS)
    for name, (implemented, what) in fields.items():
        value = hf.get(name)
        if not implemented(value):
            raise ModelLoadError(
                f"config.json sets {name}={value!r} ({what}), which the {family} family in "
                "pipepool does not implement; refusing rather than computing other math"
            )


def decide_causal(hf: dict, *, family: str, decoder: bool, attention: str) -> bool:
    """Whether the checkpoint's attention is causal: from its config, or from ``attention``
    when the user says (which a checkpoint with remote code in ``auto_map`` requires)."""
    assert attention in ATTENTION, attention
    remote = remote_code_classes(hf)
    if remote and attention == "auto":
        key, target = remote[0]
        raise ModelLoadError(
            f"config.json's auto_map sends {key} to remote code {target!r}, which pipepool does "
            f"not run: it would compute the built-in {family} family in its place, and that code "
            "may differ (gte-Qwen2's own Qwen2Model attends bidirectionally). If the remote "
            f"code is the built-in {family} family, say which attention it uses: "
            "--attention bidirectional or --attention causal (Engine(..., attention=...))"
        )
    if not decoder:
        if attention == "causal":
            raise ModelLoadError(f"the {family} family is an encoder; attention='causal' is not")
        return False
    if attention != "auto":
        return attention == "causal"
    for name in ("use_bidirectional_attention", "is_causal"):
        value = hf.get(name)
        if value is not None and not isinstance(value, bool):
            raise ModelLoadError(f"config.json sets {name}={value!r}; expected true or false")
    bidirectional, is_causal = hf.get("use_bidirectional_attention"), hf.get("is_causal")
    for name, value, harmless in (
        ("use_bidirectional_attention", bidirectional, False),
        ("is_causal", is_causal, True),
    ):
        why = _HALF_READ.get((family, name))
        if why is not None and value not in (None, harmless):
            raise ModelLoadError(
                f"config.json sets {name}={value!r}, but {why}; say which attention the "
                "checkpoint was trained with: --attention bidirectional or --attention causal"
            )
    if family in _READS_BIDIRECTIONAL:
        return not bidirectional  # transformers' default: causal
    if bidirectional is not None and (family, "use_bidirectional_attention") not in _HALF_READ:
        raise ModelLoadError(
            f"config.json sets use_bidirectional_attention={bidirectional!r}, which "
            f"transformers' {family} does not read (it reads is_causal); say which attention "
            "the checkpoint was trained with: --attention bidirectional or --attention causal"
        )
    if is_causal is None:  # transformers' default
        return True
    # The families that read it, and gemma2 where only the harmless true got this far.
    assert family in _READS_IS_CAUSAL or is_causal, family
    return is_causal


def remote_code_classes(hf: dict) -> list[tuple[str, str]]:
    """(auto_map key, class path) of every entry that loads remote model or config code."""
    auto_map = hf.get("auto_map") or {}
    found = []
    for key, target in auto_map.items():
        if key.startswith(_CODE_KEYS):
            # A value may be "module.Class", "repo--module.Class" or a [slow, fast] pair.
            found.append((key, target if isinstance(target, str) else str(target)))
    return found
