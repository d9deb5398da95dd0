"""pipepool: pipeline-parallel inference for pooling models, exact under chunked prefill.

Names are imported on first use: ``import pipepool`` stays cheap, and the driver side
(``pipepool.core``) imports without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .runtime.user_cache import keep_bytecode

# Before anything of ours imports torch: where its install has no bytecode, every start would
# compile its source again (user_cache.py).
keep_bytecode()

__version__ = "0.1.0"

_EXPORTS = {
    "ChatPrompt": "intake.vlm_chat",
    "CrossEncoder": "api.cross_encoder",
    "Engine": "api.engine",
    "EngineInfo": "api.engine_info",
    "Retriever": "api.retriever",
    "SentenceTransformer": "api.st_compat",
    "EngineConfig": "config",
    "Submission": "core.submission",
    "EngineDeadError": "errors",
    "InvalidInputError": "errors",
    "ModelLoadError": "errors",
    "ModelNotFoundError": "api.routing",
    "PipepoolError": "errors",
    "PromptTooLongError": "errors",
    "StageFailure": "errors",
    "StateDivergence": "errors",
    "Router": "api.router",
    "quantize_embeddings": "api.quantization",
}
__all__ = [
    "ChatPrompt",
    "CrossEncoder",
    "Engine",
    "EngineConfig",
    "EngineDeadError",
    "EngineInfo",
    "InvalidInputError",
    "ModelLoadError",
    "ModelNotFoundError",
    "PipepoolError",
    "PromptTooLongError",
    "Retriever",
    "Router",
    "SentenceTransformer",
    "StageFailure",
    "StateDivergence",
    "Submission",
    "quantize_embeddings",
]

if TYPE_CHECKING:
    from .api.cross_encoder import CrossEncoder
    from .api.engine import Engine
    from .api.engine_info import EngineInfo
    from .api.quantization import quantize_embeddings
    from .api.retriever import Retriever
    from .api.router import Router
    from .api.routing import ModelNotFoundError
    from .api.st_compat import SentenceTransformer
    from .config import EngineConfig
    from .core.submission import Submission
    from .errors import (
        EngineDeadError,
        InvalidInputError,
        ModelLoadError,
        PipepoolError,
        PromptTooLongError,
        StageFailure,
        StateDivergence,
    )
    from .intake.vlm_chat import ChatPrompt


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value  # next time, a plain attribute
        return value
    raise AttributeError(f"module 'pipepool' has no attribute {name!r}")
