"""``EngineAdapter``: what every adapter over an ``Engine`` shares (``SentenceTransformer``,
``CrossEncoder``, ``Retriever``): the engine it calls, and whether it owns that engine."""

from __future__ import annotations

import os
from typing import Any, Self

from ..errors import InvalidInputError
from .engine import Engine


class EngineAdapter:
    """An adapter's engine (``engine``). Built from a model (a folder or hub id, with
    ``Engine`` options), the adapter starts its own engine and closes it in ``close()`` (or at
    the end of a ``with`` block); built from an ``Engine``, it shares that engine (other
    adapters, the caller's own calls), refuses Engine options by name, and ``close()`` leaves
    the engine running."""

    _called = "adapter"  # what the refusal of an option beside a shared engine calls it

    def __init__(
        self, model: str | os.PathLike[str] | Engine | None = None, **engine_options: Any
    ) -> None:
        if isinstance(model, Engine):
            if engine_options:
                name = next(iter(engine_options))
                raise InvalidInputError(
                    f"{name}= is an option of a new Engine; this {self._called} shares the "
                    "engine it was given: start that Engine with it instead",
                    param=name,
                )
            self.engine, self._owns_engine = model, False
        else:
            model = os.fspath(model) if model is not None else None
            self.engine, self._owns_engine = Engine(model, **engine_options), True

    def close(self) -> None:
        """Close the engine this adapter started; a shared engine keeps running."""
        if self._owns_engine:
            self.engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
