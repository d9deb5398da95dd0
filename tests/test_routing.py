"""One routing rule (``api.routing.route``) for ``Router`` and the server's ``ServedModels``:
the rule itself, then both front ends over the same started engines answering every case alike
(a name no model has, no name with one model or several, a task no model does, a named model
that cannot do the task), each error the other's in its own terms."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest

from pipepool import Engine, InvalidInputError, Router
from pipepool.api.routing import (
    ModelLoadingError,
    ModelNotFoundError,
    ModelRequiredError,
    NoModelForTaskError,
    RoutedModel,
    route,
)
from pipepool.server.errors import APIError
from pipepool.server.models import ModelNames, ServedModel, ServedModels
from pipepool.server.routes.shared import check_task

EMB = RoutedModel(("emb", "minilm"), ("embed",))
CE = RoutedModel(("ce",), ("score", "rerank", "classify"))
M3 = RoutedModel(("m3",), ("embed", "sparse", "multi_vector", "score", "rerank"))
LOADING = RoutedModel(("late",), None)


@pytest.mark.parametrize(
    ("models", "name", "tasks", "picked"),
    [
        ([EMB, CE], "ce", ("embed",), 1),  # a name wins over the task: the model refuses it
        ([EMB, CE], "minilm", (), 0),  # any name the model answers to
        ([CE], None, ("embed",), 0),  # one model: it, as if named
        ([LOADING], None, ("embed",), 0),
        ([EMB, CE], None, ("rerank",), 1),
        ([EMB, M3], None, ("embed", "sparse"), 1),  # every task asked, not any
    ],
)
def test_the_rule_picks(models, name, tasks, picked):
    assert route(models, name, tasks) == picked


@pytest.mark.parametrize(
    ("models", "name", "tasks", "error", "says"),
    [
        ([EMB, CE], "gpt-4", (), ModelNotFoundError, "no model named 'gpt-4'; the models are: "
         "emb, ce"),
        ([EMB, CE], None, (), ModelRequiredError, '2 models can do this call (emb, ce): name '
         'one as "model"'),
        ([EMB, M3], None, ("embed",), ModelRequiredError, "2 models can do embed (emb, m3)"),
        ([EMB, CE], None, ("sparse",), NoModelForTaskError, "no model here can do sparse; the "
         "models are: emb (embed); ce (score, rerank, classify)"),
        ([EMB, LOADING], None, ("sparse",), ModelLoadingError, "model late is still loading"),
        ([M3, LOADING], None, ("sparse",), ModelRequiredError, "(m3, late)"),
        ([EMB], None, ("translate",), InvalidInputError, "unknown task 'translate'"),
    ],
)  # fmt: skip
def test_the_rule_refuses(models, name, tasks, error, says):
    with pytest.raises(error) as e:
        route(models, name, tasks)
    assert says in str(e.value)
    again = pickle.loads(pickle.dumps(e.value))  # errors cross process boundaries intact
    assert (type(again), str(again)) == (type(e.value), str(e.value))


@pytest.fixture(scope="module")
def engines(minilm_path, cross_encoder_path):
    made = {
        "emb": Engine(str(minilm_path), device="cpu"),
        "ce": Engine(str(cross_encoder_path), device="cpu"),
    }
    yield made
    for engine in made.values():
        engine.close()


def _served(engines: dict[str, Engine]) -> ServedModels:
    """The server's models over ``engines``; each front holds its engine as a loaded
    ``AsyncEngine`` does (``front.owner.engine``, ``front.engine``)."""
    return ServedModels(
        [
            ServedModel(ModelNames((name,)), SimpleNamespace(owner=SimpleNamespace(engine=e),
                                                             engine=e))  # type: ignore[arg-type]
            for name, e in engines.items()
        ]
    )  # fmt: skip


# Each of the rule's errors as the server answers it: (status, code).
ANSWERS = {
    ModelNotFoundError: (404, "model_not_found"),
    ModelRequiredError: (400, "model_required"),
    NoModelForTaskError: (404, "unsupported_task"),
}


def _router_answer(router: Router, name: str | None, task: str | None) -> object:
    try:
        picked = router.engine(name, task)
        return next(n for n, _ in router.models if router.engine(n) is picked)
    except InvalidInputError as exc:
        return ANSWERS[type(exc)]


def _server_answer(models: ServedModels, name: str | None, task: str | None) -> object:
    try:
        return models.select(name, () if task is None else (task,)).name
    except APIError as exc:
        return (exc.status, exc.code)


@pytest.mark.parametrize("which", [("emb", "ce"), ("ce",)])
@pytest.mark.parametrize("name", [None, "emb", "ce", "gpt-4"])
@pytest.mark.parametrize("task", [None, "embed", "rerank", "classify", "sparse"])
def test_router_and_server_route_alike(engines, which, name, task):
    chosen = {n: engines[n] for n in which}
    router = Router.from_engines(chosen)  # not closed: the engines are the module's
    router_says = _router_answer(router, name, task)
    assert router_says == _server_answer(_served(chosen), name, task)
    if name == "gpt-4" or (name == "emb" and "emb" not in which):
        assert router_says == ANSWERS[ModelNotFoundError]


def test_a_model_that_cannot_do_the_task_is_refused_by_both(engines):
    served = _served(engines)
    for name, task, call in [
        ("emb", "rerank", lambda r: r.rerank("q", ["d"], model="emb")),
        ("ce", "embed", lambda r: r.embed(["x"], model="ce")),
    ]:
        with pytest.raises(InvalidInputError):
            call(Router.from_engines(engines))
        with pytest.raises(APIError) as e:
            check_task(served.select(name, (task,)), task)
        assert (e.value.status, e.value.code) == (404, "unsupported_task")


def test_a_router_over_started_engines_refuses_options_and_specs_mixed_in(engines, minilm_path):
    with pytest.raises(InvalidInputError, match="option 'device' applies to the models"):
        Router(engines, device="cpu")
    with pytest.raises(InvalidInputError, match="are started Engines and the others are not"):
        Router({"emb": engines["emb"], "other": str(minilm_path)})
