"""``Router``: several engines behind one object, each call sent to one of them by model name.

The router holds no inference logic: every call is the named engine's own method (``Engine``),
chosen here by name, or, with no name, as the only model that can do the call's task (as an
OpenAI-style server picks a model when a request leaves ``model`` out). What a model can do is
``engine.info.tasks`` (``routing.model_tasks``): the same answer the engine's own methods give by
accepting or refusing a call.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..config import EngineConfig
from ..errors import InvalidInputError
from .engine import Engine
from .retriever import Retriever
from .routing import (
    OUTPUT_TASKS,
    RoutedModel,
    route,
)

if TYPE_CHECKING:
    import numpy as np

    from .retrieval import RetrievalOutputs, SparseEmbedding
    from .scoring import Classification, RerankResult

log = logging.getLogger("pipepool")

ModelSpec = str | os.PathLike[str] | Mapping[str, Any]


class Router:
    """Engines by model name, one call at a time routed to one of them.

    ``Router({"name": "path/or/hub-id", ...}, **options)`` starts one ``Engine`` per model, one
    after the other in the mapping's order, with ``options`` (``EngineConfig`` fields) shared by
    all; a model given as a dict (``{"model": "path", "pipeline_parallel_size": 2}``) adds or
    overrides options for that model alone. Every spec and option is checked before the first
    engine starts (``InvalidInputError`` naming the model), and several models share the
    host's memory by a plan made first (``replicas.memory_plan``: on GPU each causal model's KV
    cache is its share of what is left; ``MemoryPlanError``, with the numbers, where they do
    not fit). If an engine fails to start, those already started are closed and its error is
    raised with a note naming the model. A mapping of engines already started (every model an
    ``Engine``, no options) is taken as is; ``Router.from_engines`` says so by its name.
    Which model answers a call is ``routing.route``'s rule, the server's too.

    The router owns its engines: ``close()`` (or leaving a ``with`` block) closes them all.
    Methods are as thread-safe as the engines': the router never changes after it is built.
    """

    def __init__(self, models: Mapping[str, ModelSpec | Engine], **options: Any) -> None:
        if "model" in options:
            raise InvalidInputError(
                "a Router's models are named in its first argument, not by model=",
                param="model",
            )
        self._engines = _started(_named(models), options)
        # What each model can do, in the router's order; fixed, as a model's deployment is.
        self._routed = [RoutedModel((name,), e.info.tasks) for name, e in self._engines.items()]

    @classmethod
    def from_engines(cls, engines: Mapping[str, Engine]) -> Router:
        """A router over engines already started, by name; it closes them on ``close()``."""
        for name, engine in _named(engines).items():
            if not isinstance(engine, Engine):
                raise InvalidInputError(
                    f"model {name!r}: from_engines takes started Engines, got "
                    f"{type(engine).__name__} (Router(...) starts engines from paths)",
                    param="models",
                )
        return cls(engines)

    # -- routing ------------------------------------------------------------------------------

    @property
    def models(self) -> list[tuple[str, tuple[str, ...]]]:
        """(name, tasks) per model, in the order the router was given them (``model_tasks``)."""
        return [(m.name, m.tasks or ()) for m in self._routed]

    def engine(self, name: str | None = None, task: str | None = None) -> Engine:
        """The engine named ``name``, whatever ``task`` is (its own methods refuse what it
        cannot do, saying what it does instead); with no name, the only model, else the only
        one that can do ``task`` (``routing.route``). Raises ``ModelNotFoundError`` for a name
        the router does not hold, ``ModelRequiredError`` / ``NoModelForTaskError`` (both
        ``InvalidInputError``) naming the choices where more than one, or none, fits."""
        return self._route(name, () if task is None else (task,))

    def _route(self, name: str | None, tasks: tuple[str, ...]) -> Engine:
        """The engine the shared rule picks (``routing.route``)."""
        return list(self._engines.values())[route(self._routed, name, tasks)]

    # -- calls, each the routed engine's method ---------------------------------------------

    def embed(self, inputs, *, model: str | None = None, **options: Any) -> np.ndarray:
        """``Engine.embed`` of ``model`` (None: the only model that embeds)."""
        return self.engine(model, "embed").embed(inputs, **options)

    def embed_sparse(
        self, inputs, *, model: str | None = None, **options: Any
    ) -> list[SparseEmbedding]:
        """``Engine.embed_sparse`` of ``model`` (None: the only model with sparse outputs)."""
        return Retriever(self.engine(model, "sparse")).embed_sparse(inputs, **options)

    def embed_multi_vector(
        self, inputs, *, model: str | None = None, **options: Any
    ) -> list[np.ndarray]:
        """``Engine.embed_multi_vector`` of ``model`` (None: the only multi-vector model)."""
        return Retriever(self.engine(model, "multi_vector")).embed_multi_vector(inputs, **options)

    def encode_outputs(
        self,
        inputs,
        outputs: str | Sequence[str] = ("dense",),
        *,
        model: str | None = None,
        **options: Any,
    ) -> RetrievalOutputs:
        """``Engine.encode_outputs`` of ``model`` (None: the only model that gives every one
        of ``outputs``; the engine checks them)."""
        wanted = [outputs] if isinstance(outputs, str) else list(outputs)
        tasks = tuple(OUTPUT_TASKS[o] for o in wanted if o in OUTPUT_TASKS)
        return self._route(model, tasks).encode_outputs(inputs, outputs, **options)

    def score(self, text_1, text_2, *, model: str | None = None, **options: Any) -> np.ndarray:
        """``Engine.score`` of ``model`` (None: the only model that scores pairs)."""
        return self.engine(model, "score").score(text_1, text_2, **options)

    def rerank(
        self, query: str, documents, *, model: str | None = None, **options: Any
    ) -> list[RerankResult]:
        """``Engine.rerank`` of ``model`` (None: the only model that reranks)."""
        return self.engine(model, "rerank").rerank(query, documents, **options)

    def classify(self, texts, *, model: str | None = None, **options: Any) -> Classification:
        """``Engine.classify`` of ``model`` (None: the only sequence classifier)."""
        return self.engine(model, "classify").classify(texts, **options)

    def classify_tokens(
        self, texts, *, model: str | None = None, **options: Any
    ) -> list[list[dict]]:
        """``Engine.classify_tokens`` of ``model`` (None: the only token classifier)."""
        return self.engine(model, "classify_tokens").classify_tokens(texts, **options)

    # -- lifetime -----------------------------------------------------------------------------

    @property
    def health(self) -> dict[str, str]:
        """Each model's ``Engine.health``: ok | degraded | dead | closed."""
        return {name: engine.health for name, engine in self._engines.items()}

    def close(self) -> None:
        """Close every engine, each even where closing one before it raised; then raise the
        first such error (noting its model)."""
        _close_all(self._engines)

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _named(models: Mapping[str, Any]) -> Mapping[str, Any]:
    """``models`` once its names are checked: a non-empty mapping of non-empty strings (a
    mapping's names are unique by construction)."""
    if not isinstance(models, Mapping) or not models:
        raise InvalidInputError(
            "a Router takes a non-empty mapping of model names to models", param="models"
        )
    for name in models:
        if not isinstance(name, str) or not name.strip():
            raise InvalidInputError(
                f"model names must be non-empty strings, got {name!r}", param="models"
            )
    return models


def _started(
    models: Mapping[str, ModelSpec | Engine], options: Mapping[str, Any]
) -> dict[str, Engine]:
    """The router's engines: ``models`` as given where every one is a started ``Engine``
    (``options`` then refused: they apply to the engines a router starts), else one engine
    started per spec, those of several models sharing the host's memory by a plan made
    first."""
    started = [name for name, spec in models.items() if isinstance(spec, Engine)]
    if not started:
        configs = {
            name: _config(name, spec, options)
            for name, spec in models.items()
            if not isinstance(spec, Engine)  # none is, here
        }
        return _start_all(_planned(configs) if len(configs) > 1 else configs)
    if len(started) < len(models):
        raise InvalidInputError(
            f"models {', '.join(map(repr, started))} are started Engines and the others are "
            "not: give a router started engines only, or only models to start (one memory "
            "plan covers the models a router starts)",
            param="models",
        )
    if options:
        raise InvalidInputError(
            f"option {next(iter(options))!r} applies to the models a router starts; these "
            "engines are started already",
            param=next(iter(options)),
        )
    return {name: e for name, e in models.items() if isinstance(e, Engine)}  # every one


def _config(name: str, spec: ModelSpec, shared: Mapping[str, Any]) -> EngineConfig:
    """The engine config of model ``name``: ``spec`` its path (or hub id), or a dict of its
    options with its path under "model", over the options ``shared`` by every model."""
    if isinstance(spec, (str, os.PathLike)):
        spec = {"model": spec}
    if not isinstance(spec, Mapping):
        raise InvalidInputError(
            f"model {name!r}: give a path or hub id, or a dict of engine options with one under "
            f'"model"; got {type(spec).__name__}',
            param="models",
        )
    path = spec.get("model")
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise InvalidInputError(
            f'model {name!r}: its options need "model" (a path or hub id); got {path!r}',
            param="models",
        )
    try:
        return EngineConfig.from_options(**{**shared, **spec, "model": os.fspath(path)})
    except InvalidInputError as exc:
        raise InvalidInputError(f"model {name!r}: {exc}", param=exc.param) from exc


def _planned(configs: Mapping[str, EngineConfig]) -> dict[str, EngineConfig]:
    """The configs as the memory plan of all of them sets them; the plan logged."""
    from ..replicas.memory_plan import plan_memory

    plan = plan_memory(list(configs.items()))
    log.info("%s", plan.describe())
    return {m.name: m.config for m in plan.models}


def _start_all(configs: Mapping[str, EngineConfig]) -> dict[str, Engine]:
    """An engine per config, started one after the other; if one fails, those started before
    it are closed and its error raised, noting the model."""
    engines: dict[str, Engine] = {}
    for name, config in configs.items():
        try:
            engines[name] = Engine.from_config(config)
        except BaseException as exc:
            if isinstance(exc, Exception):
                exc.add_note(
                    f"model {name!r} ({config.model}) did not start; the router closed the "
                    f"{len(engines)} model(s) started before it"
                )
            try:
                _close_all(engines)
            except Exception as close_error:  # the start's error is the one to raise
                log.warning("closing the models started before %r: %r", name, close_error)
            raise
    return engines


def _close_all(engines: Mapping[str, Engine]) -> None:
    """Close every engine, in reverse order of start; raise the first error once all are
    tried."""
    first: Exception | None = None
    for name, engine in reversed(list(engines.items())):
        try:
            engine.close()
        except Exception as exc:
            log.warning("closing model %r: %r", name, exc)
            exc.add_note(f"while closing model {name!r} of a router")
            first = first or exc
    if first is not None:
        raise first
