"""Activation functions by the names checkpoints use for them."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..errors import ModelLoadError

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": lambda x: x,
    "tanh": torch.tanh,
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "gelu": F.gelu,  # exact erf form, as HF's "gelu"
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ModelLoadError(
            f"activation {name!r} is not supported ({', '.join(ACTIVATIONS)})"
        ) from None
