"""pipepool: pipeline-parallel inference for pooling models, exact under chunked prefill."""

from .config import EngineConfig
from .engine import Engine
from .errors import (
    EngineDeadError,
    InvalidInputError,
    ModelLoadError,
    PipepoolError,
    PromptTooLongError,
    StageFailure,
    StateDivergence,
)

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineDeadError",
    "InvalidInputError",
    "ModelLoadError",
    "PipepoolError",
    "PromptTooLongError",
    "StageFailure",
    "StateDivergence",
]
__version__ = "0.1.0"
