"""sentence-transformers' ``Dense`` modules (``2_Dense``; a MultiVectorEncoder's token-level
ones), read from their folders, and the JSON reading every folder reader shares."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError

_ST_ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.modules.activation.ReLU": "relu",
    "torch.nn.modules.activation.GELU": "gelu",
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.activation.SiLU": "silu",
}


@dataclass(frozen=True)
class DenseModule:
    """A sentence-transformers ``Dense`` head applied to the pooled vector (``2_Dense``)."""

    path: Path  # folder holding config.json and the weights
    in_features: int
    out_features: int
    bias: bool
    activation: str  # a key of layers.activation.ACTIVATIONS


def read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None


def read_st_dense(folder: Path, default_activation: str = "Tanh") -> DenseModule:
    """A sentence-transformers Dense module's folder (``default_activation``: where its config
    names none)."""
    config = read_json(folder / "config.json")
    fallback = "torch.nn.modules.activation.Tanh"
    if default_activation == "Identity":
        fallback = "torch.nn.modules.linear.Identity"
    activation = config.get("activation_function", fallback)
    if activation not in _ST_ACTIVATIONS:
        raise ModelLoadError(f"{folder}: Dense activation {activation!r} is not supported")
    if config.get("use_residual"):
        raise ModelLoadError(f"{folder}: Dense with use_residual is not supported")
    return DenseModule(
        path=folder,
        in_features=int(config["in_features"]),
        out_features=int(config["out_features"]),
        bias=bool(config.get("bias", True)),
        activation=_ST_ACTIVATIONS[activation],
    )
