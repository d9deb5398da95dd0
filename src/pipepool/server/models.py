"""The models a server serves, by the names clients send as ``model``.

A server serves one model or several (``pipepool serve --model a=PATH --model b=PATH``), each
with its own engine, queue (``AsyncEngine``: its own 429) and names. A request is answered by
the model ``api.routing.route`` picks, the rule ``api.router.Router`` follows too: the one it
names, or, where it names none, the only model, else the only one that can do what it asks.
That choice is made here, once per request, its errors answered as HTTP errors, and the routes
use the chosen model's ``front``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from ..api.routing import (
    TASKS,
    ModelLoadingError,
    ModelNotFoundError,
    ModelRequiredError,
    NoModelForTaskError,
    RoutedModel,
    route,
)
from ..errors import InvalidInputError
from ..loading.model_folder import BUNDLED_MODEL_ID, hub_id_of_snapshot
from .errors import SERVER, APIError, model_not_found
from .front import AsyncEngine


@dataclass(frozen=True)
class ModelNames:
    """The names clients may send for one model; the first is the one responses carry.
    ``tasks``: what the model is offered for (None: all it can do, ``api.routing.TASKS``)."""

    names: tuple[str, ...]
    tasks: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not self.names or not all(self.names):
            raise InvalidInputError("served model names must not be empty", param="model")
        unknown = [t for t in self.tasks or () if t not in TASKS]
        if unknown:
            raise InvalidInputError(
                f"unknown task {unknown[0]!r}; tasks are {', '.join(TASKS)}", param="tasks"
            )

    @property
    def name(self) -> str:
        return self.names[0]

    @cached_property  # one look at the disk per server, not per request
    def shown(self) -> tuple[str, ...]:
        """The names a response may show (/v1/models, /info, errors): every accepted name but
        a path to a local folder, which would tell clients how the server's disk is laid out
        (the path stays accepted: a vLLM server's default name is its path). The first name,
        what responses carry, is always shown."""
        return (self.name, *(n for n in self.names[1:] if not _is_folder_path(n)))

    def response_name(self, requested: str | None) -> str:
        """The model name a response carries for a request that named ``requested`` (already
        checked to be this model's): that name, or the first one where it is not shown."""
        if requested is None or requested not in self.shown:
            return self.name
        return requested


@dataclass
class ServedModel:
    """One model of the server: its names and the engine that answers for it."""

    names: ModelNames
    front: AsyncEngine

    @property
    def name(self) -> str:
        return self.names.name

    def tasks(self) -> tuple[str, ...] | None:
        """What this model answers (``api.routing.TASKS``), None until it has loaded: what it
        can do (``engine.info.tasks``), less what the server was told not to offer it for."""
        engine = self.front.owner.engine
        if engine is None:
            return None
        can = engine.info.tasks
        offered = self.names.tasks
        return can if offered is None else tuple(t for t in can if t in offered)

    def with_front(self, front: AsyncEngine) -> ServedModel:
        return ServedModel(self.names, front)


@dataclass
class ServedModels:
    """Every model a server serves, in the order it was given (the first is the default of
    routes that name no model and serve one kind of answer only, as TEI's ``/info``)."""

    models: Sequence[ServedModel]
    _by_name: dict[str, ServedModel] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.models:
            raise InvalidInputError("a server serves at least one model", param="model")
        self._by_name = {}
        for model in self.models:
            for name in model.names.names:
                other = self._by_name.setdefault(name, model)
                if other is not model:
                    raise InvalidInputError(
                        f"two models answer to the name {name!r} ({other.name} and "
                        f"{model.name}); give each its own name (NAME=PATH)",
                        param="model",
                    )

    @classmethod
    def one(cls, front: AsyncEngine, names: Sequence[str]) -> ServedModels:
        """A server of one model."""
        return cls([ServedModel(ModelNames(tuple(names)), front)])

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self.models)

    def __len__(self) -> int:
        return len(self.models)

    @property
    def first(self) -> ServedModel:
        return self.models[0]

    @property
    def shown_names(self) -> tuple[str, ...]:
        return tuple(n for m in self.models for n in m.names.shown)

    def with_fronts(self, front_of: dict[int, AsyncEngine]) -> ServedModels:
        """The same models over other fronts (``front_of[i]`` for model ``i``)."""
        return ServedModels([m.with_front(front_of[i]) for i, m in enumerate(self.models)])

    def select(self, name: str | None, tasks: Sequence[str] = ()) -> ServedModel:
        """The model a request asks for (``api.routing.route``: the one named ``name``, or
        with no name the only model, else the only one doing every one of ``tasks``), the
        rule's errors as HTTP answers: 404 ``model_not_found`` for a name no model has; with
        no name, 400 ``model_required`` when several models could answer (naming them), 503
        while the one that could is still loading, 404 ``unsupported_task`` when none can.
        Whether a model chosen by name (or as the only one) does the task is the route's check
        (``check_task``): 404 ``unsupported_task``, naming what it does."""
        routed = [RoutedModel(m.names.names, m.tasks()) for m in self.models]
        try:
            return self.models[route(routed, name, tasks)]
        except ModelNotFoundError:
            raise model_not_found(str(name), self.shown_names) from None
        except ModelRequiredError as exc:
            raise APIError(400, str(exc), param="model", code="model_required") from None
        except ModelLoadingError as exc:
            raise APIError(503, str(exc), type=SERVER, code="engine_unavailable") from None
        except NoModelForTaskError as exc:
            raise APIError(404, str(exc), param="model", code="unsupported_task") from None


def served_model_names(model: str | None, extra: str | None = None) -> tuple[str, ...]:
    """Every name a client may reasonably use for ``--model``: the names given with
    ``--served-model-name`` (comma-separated; the first is the one responses carry), then the
    hub id (``org/name``) and its short name (``name``, what OpenAI-style examples use), and a
    local folder's name and the path as given."""
    names = [n.strip() for n in (extra or "").split(",") if n.strip()]
    if model is None:
        names += [BUNDLED_MODEL_ID, BUNDLED_MODEL_ID.split("/")[1]]
    else:
        path = Path(model).expanduser()
        hub_id = hub_id_of_snapshot(path)
        if hub_id:
            names += [hub_id, hub_id.split("/")[1]]
        elif not path.is_dir() and model.count("/") == 1:  # a hub id
            names += [model, model.split("/")[1]]
        if path.is_dir():
            names += [path.resolve().name, model]
    return tuple(dict.fromkeys(names))  # no repeats, first mention first


def _is_folder_path(name: str) -> bool:
    """Whether a served name is a local folder given by its path (``/srv/models/x``, ``./x``,
    ``~/x``), rather than a bare name or a hub id."""
    path = Path(name).expanduser()
    return path.name != name and path.is_dir()
