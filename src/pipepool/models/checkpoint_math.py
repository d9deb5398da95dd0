"""What math a checkpoint asks for, read from its config, and the refusal of anything the
families do not implement.

A checkpoint's config decides its math, never the family's habit: a decoder whose config says
``is_causal: false`` attends bidirectionally (as transformers runs it), and a field that would
change the math in a way no family here computes is refused by name. Remote code named by
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
}

# Decoders whose transformers implementation reads ``is_causal`` from the config (the mask is
# bidirectional when it is false). None of them reads ``use_bidirectional_attention``.
_READS_IS_CAUSAL = ("qwen3", "qwen2", "llama", "mistral")

# auto_map keys that load model code (or a config class that may read fields differently).
_CODE_KEYS = ("AutoConfig", "AutoModel")


def _absent_or(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in allowed


def _falsy(value: Any) -> bool:
    return not value


# Config fields that change the math, by family, with the values this implementation computes.
# A checkpoint with any other value is refused by name rather than computed without it.
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
_ENCODER_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "is_decoder": (_falsy, "a causal (decoder) mask"),
    "is_causal": (lambda v: v is None or v is False, "a causal mask"),
    "use_bidirectional_attention": (lambda v: v is None or v is True, "a causal mask"),
    "add_cross_attention": (_falsy, "cross-attention"),
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
    fields = _DECODER_FIELDS if decoder else _ENCODER_FIELDS
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
    if hf.get("use_bidirectional_attention") is not None:
        raise ModelLoadError(
            f"config.json sets use_bidirectional_attention="
            f"{hf['use_bidirectional_attention']!r}, which transformers' {family} does not read "
            "(it reads is_causal); say which attention the checkpoint was trained with: "
            "--attention bidirectional or --attention causal"
        )
    is_causal = hf.get("is_causal")
    if is_causal is None:  # transformers' default
        return True
    if not isinstance(is_causal, bool):
        raise ModelLoadError(f"config.json sets is_causal={is_causal!r}; expected true or false")
    assert family in _READS_IS_CAUSAL, family
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
