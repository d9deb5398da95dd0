"""Activation functions by the names checkpoints use for them."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..errors import ModelLoadError

# The names checkpoints give GELU's tanh approximation (Gemma's GeGLU kernel computes these).
TANH_GELUS = frozenset({"gelu_new", "gelu_pytorch_tanh"})

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": lambda x: x,
    "tanh": torch.tanh,
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "gelu": F.gelu,  # exact erf form, as HF's "gelu"
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),  # CLIP's, as HF computes it
    **dict.fromkeys(sorted(TANH_GELUS), lambda x: F.gelu(x, approximate="tanh")),
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ModelLoadError(
            f"activation {name!r} is not supported ({', '.join(ACTIVATIONS)})"
        ) from None
