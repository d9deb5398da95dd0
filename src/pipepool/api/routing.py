"""The one rule that picks a model for a call, shared by ``Router`` and the server.

A call names a model, or leaves the name out and says what it needs done (``tasks``). The
rule, the same for ``Router`` and for ``pipepool serve`` (``server.models.ServedModels``):

1. A name picks the model that answers to it, whatever the tasks (its own methods refuse what
   it cannot do, saying what it does instead); a name no model has is ``ModelNotFoundError``.
2. No name and one model: that model, as if named (an OpenAI-style server of one model
   answers every request that leaves ``model`` out).
3. No name and several models: the only one that does every task asked (no task: any model).
   Several that could: ``ModelRequiredError``, naming them; one still loading among those that
   might: the call waits on no guess (``ModelLoadingError`` where it is the only candidate,
   ``ModelRequiredError`` where others could answer too); none: ``NoModelForTaskError``,
   listing what each model does.

What a model does is ``model_tasks``, derived from its deployment: the same answer the
engine's own methods give by accepting or refusing a call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import InvalidInputError, ModelLoadError, PipepoolError
from .retrieval_scoring import scores_pairs_itself

if TYPE_CHECKING:
    from ..loading.deployment import Deployment

# Every task a model may have, in the order ``model_tasks`` lists them. Each is one Engine
# method family: embed (embed, encode, pool, ...), sparse (embed_sparse), multi_vector
# (embed_multi_vector), score / rerank (pairs), classify (one row of labels per text),
# classify_tokens (a token classifier's labels per token).
TASKS = ("embed", "sparse", "multi_vector", "score", "rerank", "classify", "classify_tokens")
# encode_outputs' outputs as tasks.
OUTPUT_TASKS = {"dense": "embed", "sparse": "sparse", "multi_vector": "multi_vector"}


class ModelNotFoundError(InvalidInputError):
    """A call named a model no one answers to (``param`` is "model"; ``names``: the models'
    names)."""

    def __init__(self, name: object, names: Sequence[str]) -> None:
        super().__init__(
            f"no model named {name!r}; the models are: {', '.join(names)}", param="model"
        )
        self.name = name
        self.names = tuple(names)

    def __reduce__(self):  # built again from its two arguments
        return (type(self), (self.name, self.names))


class ModelRequiredError(InvalidInputError):
    """A call without a model name that several models could answer (``param`` is "model";
    ``names``: those models)."""

    def __init__(self, what: str, names: Sequence[str]) -> None:
        super().__init__(
            f'{len(names)} models can do {what} ({", ".join(names)}): name one as "model"',
            param="model",
        )
        self.what = what
        self.names = tuple(names)

    def __reduce__(self):
        return (type(self), (self.what, self.names))


class NoModelForTaskError(InvalidInputError):
    """A call without a model name that no model can answer (``param`` is "model";
    ``tasks``: what it asked for)."""

    def __init__(self, tasks: Sequence[str], listing: str) -> None:
        what = " and ".join(tasks) or "this call"
        super().__init__(f"no model here can do {what}; the models are: {listing}", param="model")
        self.tasks = tuple(tasks)
        self.listing = listing

    def __reduce__(self):
        return (type(self), (self.tasks, self.listing))


class ModelLoadingError(PipepoolError, RuntimeError):
    """A call without a model name whose only possible model is still loading (a server's
    models load in the background): retry once it has loaded."""

    def __init__(self, name: str) -> None:
        super().__init__(f"model {name} is still loading; retry shortly")
        self.name = name

    def __reduce__(self):
        return (type(self), (self.name,))


@dataclass(frozen=True)
class RoutedModel:
    """A model as the rule sees it: ``names``, every name it answers to (the first is its
    own); ``tasks``, what it does (``TASKS`` order), or None while it loads."""

    names: tuple[str, ...]
    tasks: tuple[str, ...] | None

    @property
    def name(self) -> str:
        return self.names[0]


def route(models: Sequence[RoutedModel], name: str | None, tasks: Sequence[str] = ()) -> int:
    """The index in ``models`` of the model that answers a call naming ``name`` (None: no
    name) and needing every one of ``tasks`` (this module's rule). Raises
    ``InvalidInputError`` for a task not in ``TASKS``, and the errors the rule names."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise InvalidInputError(
            f"unknown task {unknown[0]!r}; tasks are: {', '.join(TASKS)}", param="task"
        )
    if name is not None:
        for i, model in enumerate(models):
            if name in model.names:
                return i
        raise ModelNotFoundError(name, [m.name for m in models])
    if len(models) == 1:
        return 0
    able = [i for i, m in enumerate(models) if m.tasks is not None and set(tasks) <= set(m.tasks)]
    loading = [i for i, m in enumerate(models) if m.tasks is None]
    what = " and ".join(tasks) or "this call"
    if len(able) + len(loading) > 1:
        raise ModelRequiredError(what, [models[i].name for i in able + loading])
    if able:
        return able[0]
    if loading:
        raise ModelLoadingError(models[loading[0]].name)
    listing = "; ".join(f"{m.name} ({', '.join(m.tasks or ()) or 'nothing'})" for m in models)
    raise NoModelForTaskError(tasks, listing)


def model_tasks(deployment: Deployment) -> tuple[str, ...]:
    """What a model can be asked to do, in ``TASKS`` order: "embed", "sparse" and
    "multi_vector" for the outputs it gives (``deployment.outputs``) where it is no classifier
    (a classifier's hidden states are not embeddings); "score" and "rerank" for a one-label
    classifier, for a model that scores pairs from its retrieval outputs (ColBERT, BGE-M3) and
    for ColQwen2 (MaxSim of queries against page images, ``api/page_retrieval.py``);
    "classify" for a sequence classifier; "classify_tokens" for a token classifier."""
    head = deployment.classifier
    found: set[str] = set()
    if head is None:
        found.update(OUTPUT_TASKS[o] for o in deployment.outputs)
        if scores_pairs_itself(deployment) or retrieves_pages(deployment):
            found.update(("score", "rerank"))
    elif head.per_token:
        found.add("classify_tokens")
    else:
        found.add("classify")
        if head.can_rerank:
            found.update(("score", "rerank"))
    return tuple(t for t in TASKS if t in found)


def retrieves_pages(deployment: Deployment) -> bool:
    """Whether the model is ColQwen2 (queries against page images by MaxSim)."""
    from ..models import family_of
    from .vlm import PAGE_FAMILIES

    try:
        return family_of(deployment.folder.architecture).name in PAGE_FAMILIES
    except ModelLoadError:  # a dual encoder: none of the decoder families
        return False
