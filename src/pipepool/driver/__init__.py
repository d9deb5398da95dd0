"""Everything between a call's token batches and its results: the ``Pipeline`` protocol and
its implementations (``local.LocalPipeline``: one pipeline's loop, pacing, healing and
delivery; ``replicas.pipeline.ReplicaPipeline``: replicas of it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import EngineConfig
    from .pipeline import Pipeline


def open_pipeline(config: EngineConfig) -> Pipeline:
    """The pipeline an EngineConfig asks for: replicas when ``data_parallel_size`` > 1."""
    if config.data_parallel_size > 1:
        from ..replicas.pipeline import ReplicaPipeline

        return ReplicaPipeline(config)
    from .local import LocalPipeline

    return LocalPipeline(config)
