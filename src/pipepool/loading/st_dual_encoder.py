"""sentence-transformers 6's folders of a dual encoder (CLIP, SigLIP): one multimodal
``Transformer`` module whose ``modality_config`` sends texts to ``get_text_features`` and
images to ``get_image_features`` (their ``pooler_output``: the projected vectors), optionally
followed by ``Normalize``. Anything else in such a folder would compute other vectors, and is
refused by name."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..errors import ModelLoadError
from .st_dense import read_json

# What each modality runs in sentence-transformers 6 (its ``_FEATURE_EXTRACTION_EDGE_CASES``
# and inference for CLIP-like models), which is what the towers compute.
MODALITIES = {
    "text": {"method": "get_text_features", "method_output_name": "pooler_output"},
    "image": {"method": "get_image_features", "method_output_name": "pooler_output"},
}
MODULES = ("Transformer", "Normalize")


def check_dual_encoder_st(path: Path, kinds: list[str]) -> None:
    """Refuse a dual encoder's sentence-transformers folder that computes something the two
    towers do not; ``kinds``: its modules' kinds, in order."""
    modules = path / "modules.json"
    if not kinds or kinds[0] != "Transformer" or any(k not in MODULES for k in kinds):
        raise ModelLoadError(
            f"{modules}: a dual encoder's folder is a Transformer module, optionally followed by "
            f"Normalize; found {', '.join(kinds)}"
        )
    config_file = path / "sentence_bert_config.json"
    config = read_json(config_file) if config_file.is_file() else {}
    allowed = {"transformer_task", "modality_config", "module_output_name", "max_seq_length"}
    unknown = sorted(set(config) - allowed)
    if unknown:
        raise ModelLoadError(
            f"{config_file}: {unknown[0]!r} is not supported for a dual encoder (it may change "
            "how inputs are prepared or what is computed)"
        )
    if config.get("transformer_task", "feature-extraction") != "feature-extraction":
        raise ModelLoadError(
            f"{config_file}: transformer_task {config['transformer_task']!r}; a dual encoder "
            "runs feature-extraction"
        )
    for modality, spec in (config.get("modality_config") or {}).items():
        if MODALITIES.get(modality) != spec:
            raise ModelLoadError(
                f"{config_file}: modality_config[{modality!r}] = {spec!r}; pipepool's towers "
                f"compute {', '.join(f'{k}: {v}' for k, v in MODALITIES.items())}"
            )
    output = config.get("module_output_name", "sentence_embedding")
    if output != "sentence_embedding":
        raise ModelLoadError(
            f"{config_file}: module_output_name {output!r}; the towers give sentence_embedding"
        )


def processor_config(path: Path) -> tuple[Path, dict]:
    """A dual encoder's image processor settings: ``preprocessor_config.json`` (transformers'
    saves), else the ``image_processor`` of ``processor_config.json`` (sentence-transformers
    6's); empty where neither exists (transformers' defaults then apply)."""
    file = path / "preprocessor_config.json"
    if file.is_file():
        return file, read_json(file)
    file = path / "processor_config.json"
    if file.is_file():
        return file, dict(read_json(file).get("image_processor") or {})
    return file, {}


def checked_processor_config(
    path: Path, kinds: Sequence[str], read: set[str], ignored: set[str], what: str
) -> tuple[Path, dict]:
    """``processor_config`` refused where it names an image processor other than ``kinds``
    or a key neither ``read`` nor ``ignored`` (``what``: the preprocessing, in words)."""
    file, given = processor_config(path)
    kind_of = given.get("image_processor_type")
    if kind_of is not None and kind_of not in kinds:
        raise ModelLoadError(f"{file}: image_processor_type {kind_of!r} is not a {what} one")
    unknown = sorted(set(given) - read - ignored)
    if unknown:
        raise ModelLoadError(
            f"{file}: {unknown[0]!r} is not implemented by pipepool's {what} image "
            "preprocessing; refusing rather than preprocessing differently"
        )
    return file, given
