"""``pipepool.Router``: several in-process engines behind one object. A call through the router
is the routed engine's own call (the same result as that model's engine alone); a call without
a model name goes to the only model that can do it; names, specs and failures are named."""

from __future__ import annotations

import pickle
import re
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import tiny_models
import tiny_retrieval

import pipepool
from pipepool import Engine, InvalidInputError, ModelLoadError, ModelNotFoundError, Router
from pipepool.api.routing import model_tasks
from pipepool.core.classifier_head import ClassifierHead
from pipepool.loading.retrieval import ColbertHead, SpladeHead, outputs_of

TEXTS = ["hello world", "The weather is lovely today.", "x"]
QUERY = "how is the weather?"


@pytest.fixture(scope="module")
def folders(tmp_path_factory, minilm_path, cross_encoder_path) -> dict[str, str]:
    """One model of each kind, by router name: an embedder, a one-label cross-encoder, a
    three-label classifier, BGE-M3 (dense, sparse and multi-vector outputs; scores pairs)."""
    root = tmp_path_factory.mktemp("router")
    return {
        "emb": str(minilm_path),
        "ce": str(cross_encoder_path),
        "clf": str(tiny_models.make_decoder_classifier(root / "classifier", "qwen3")),
        "m3": str(tiny_retrieval.build_bge_m3(root / "m3")),
    }


@pytest.fixture(scope="module")
def router(folders):
    with Router(folders) as router:
        yield router


@pytest.fixture(scope="module")
def alone(folders):
    """Each model's engine on its own, outside any router."""
    engines = {name: Engine(path) for name, path in folders.items()}
    yield engines
    for engine in engines.values():
        engine.close()


@pytest.fixture
def started(monkeypatch) -> list[Engine]:
    """Every engine the routers of a test start, in order."""
    engines: list[Engine] = []
    start = Engine.from_config.__func__  # type: ignore[attr-defined]

    def recorded(cls, config, pipeline=None) -> Engine:
        engine = start(cls, config, pipeline)
        engines.append(engine)
        return engine

    monkeypatch.setattr(Engine, "from_config", classmethod(recorded))
    return engines


def test_models_lists_each_models_tasks(router):
    assert router.models == [
        ("emb", ("embed",)),
        ("ce", ("score", "rerank", "classify")),
        ("clf", ("classify",)),
        ("m3", ("embed", "sparse", "multi_vector", "score", "rerank")),
    ]
    assert router.health == {"emb": "ok", "ce": "ok", "clf": "ok", "m3": "ok"}


_SPLADE = SpladeHead((), "gelu", 1e-12, 30522, "max", "relu")
_COLBERT = ColbertHead((), 1, 2, 32, 180, True, False, 103, (), 32)
_NER = ClassifierHead("token", 3, ("O", "PER", "LOC"), "softmax", "pair")


@pytest.mark.parametrize(
    ("classifier", "retrieval", "tasks", "architecture"),
    [(None, _SPLADE, ("sparse",), "BertForMaskedLM"),
     (None, _COLBERT, ("multi_vector", "score", "rerank"), "BertModel"),
     (_NER, None, ("classify_tokens",), "BertForTokenClassification"),
     (None, None, ("embed", "score", "rerank"), "ColQwen2ForRetrieval")],
)  # fmt: skip
def test_model_tasks_of_the_kinds_not_started_here(classifier, retrieval, tasks, architecture):
    deployment = SimpleNamespace(
        classifier=classifier, retrieval=retrieval, outputs=outputs_of(retrieval),
        folder=SimpleNamespace(architecture=architecture),
    )  # fmt: skip
    assert model_tasks(deployment) == tasks  # type: ignore[arg-type]


def test_calls_by_name_equal_the_engine_alone(router, alone):
    for name in ("emb", "m3"):
        np.testing.assert_array_equal(
            router.embed(TEXTS, model=name, normalize=False),
            alone[name].embed(TEXTS, normalize=False),
        )
    for name in ("ce", "m3"):
        np.testing.assert_array_equal(
            router.score(QUERY, TEXTS, model=name), alone[name].score(QUERY, TEXTS)
        )
        assert router.rerank(QUERY, TEXTS, model=name, top_n=2) == alone[name].rerank(
            QUERY, TEXTS, top_n=2
        )
    for name in ("ce", "clf"):
        got, want = router.classify(TEXTS, model=name), alone[name].classify(TEXTS)
        np.testing.assert_array_equal(got.probs, want.probs)
        assert got.label_names == want.label_names


def test_a_call_without_a_name_goes_to_the_only_model_of_its_task(router, alone):
    m3 = alone["m3"]
    assert router.engine(task="sparse") is router.engine("m3")
    sparse = router.embed_sparse(TEXTS, top_k=4)
    for got, want in zip(sparse, pipepool.Retriever(m3).embed_sparse(TEXTS, top_k=4), strict=True):
        np.testing.assert_array_equal(got.indices, want.indices)
        np.testing.assert_array_equal(got.values, want.values)
    vectors = router.embed_multi_vector(TEXTS, is_query=True)
    for got, want in zip(
        vectors, pipepool.Retriever(m3).embed_multi_vector(TEXTS, is_query=True), strict=True
    ):
        np.testing.assert_array_equal(got, want)
    out = router.encode_outputs(TEXTS, ["dense", "multi_vector"])
    want = m3.encode_outputs(TEXTS, ["dense", "multi_vector"])
    np.testing.assert_array_equal(out.dense, want.dense)
    assert out.num_tokens == want.num_tokens


def test_from_engines_routes_each_task_to_its_only_model(alone):
    router = Router.from_engines({"emb": alone["emb"], "ce": alone["ce"]})
    assert router.engine(task="embed") is alone["emb"]
    assert router.engine(task="classify") is alone["ce"]
    np.testing.assert_array_equal(router.embed(TEXTS), alone["emb"].embed(TEXTS))
    np.testing.assert_array_equal(router.score(QUERY, TEXTS), alone["ce"].score(QUERY, TEXTS))
    # No task, two models: a name is needed; one model: it is the one.
    with pytest.raises(InvalidInputError, match=r"2 models can do this call \(emb, ce\)"):
        router.engine()
    assert Router.from_engines({"ce": alone["ce"]}).engine() is alone["ce"]
    with pytest.raises(InvalidInputError, match="model 'ce': from_engines takes started"):
        Router.from_engines({"ce": "path/to/model"})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    ("call", "choices"),
    [
        (lambda r: r.embed(TEXTS), "embed (emb, m3)"),
        (lambda r: r.score(QUERY, TEXTS), "score (ce, m3)"),
        (lambda r: r.rerank(QUERY, TEXTS), "rerank (ce, m3)"),
        (lambda r: r.classify(TEXTS), "classify (ce, clf)"),
        (lambda r: r.encode_outputs(TEXTS), "embed (emb, m3)"),
    ],
)
def test_an_ambiguous_task_names_the_models_that_can_do_it(router, call, choices):
    with pytest.raises(
        InvalidInputError, match=re.escape(f"2 models can do {choices}: name one")
    ) as e:
        call(router)
    assert e.value.param == "model"


def test_a_task_no_model_has_is_refused_listing_what_each_does(router):
    with pytest.raises(InvalidInputError, match="no model here can do classify_tokens") as e:
        router.classify_tokens(TEXTS)
    assert "clf (classify)" in str(e.value)
    with pytest.raises(InvalidInputError, match="unknown task 'translate'; tasks are: embed"):
        router.engine(task="translate")


def test_an_unknown_name_is_model_not_found_listing_the_names(router):
    with pytest.raises(ModelNotFoundError) as e:
        router.embed(TEXTS, model="gpt-4")
    error = e.value
    assert isinstance(error, InvalidInputError) and error.param == "model"
    assert str(error) == "no model named 'gpt-4'; the models are: emb, ce, clf, m3"
    again = pickle.loads(pickle.dumps(error))
    assert (type(again), str(again), again.names) == (ModelNotFoundError, str(error), error.names)


def test_a_named_model_that_cannot_do_the_call_refuses_it_itself(router):
    with pytest.raises(InvalidInputError, match="is a classifier with 1 label"):
        router.embed(TEXTS, model="ce")
    with pytest.raises(InvalidInputError, match="is an embedding model and cannot do scoring"):
        router.score(QUERY, TEXTS, model="emb")


def test_per_model_options_override_the_shared_ones_and_close_closes_all(folders, started):
    with Router(
        {"ce": {"model": folders["ce"], "max_model_len": 32}, "clf": folders["clf"]},
        max_model_len=64,
    ) as router:
        assert router.engine("ce").config.max_model_len == 32
        assert router.engine("clf").config.max_model_len == 64
        assert [e.config.model for e in started] == [folders["ce"], folders["clf"]]
    assert router.health == {"ce": "closed", "clf": "closed"}
    assert [e.health for e in started] == ["closed", "closed"]


@pytest.mark.parametrize(
    ("models", "options", "message"),
    [
        ({}, {}, "non-empty mapping of model names"),
        ([("emb", "x")], {}, "non-empty mapping of model names"),
        ({"": "x"}, {}, "model names must be non-empty strings, got ''"),
        ({3: "x"}, {}, "model names must be non-empty strings, got 3"),
        ({"emb": 3}, {}, "model 'emb': give a path or hub id, or a dict"),
        ({"emb": {"max_model_len": 8}}, {}, "model 'emb': its options need \"model\""),
        ({"emb": {"model": "x", "bogus": 1}}, {}, "model 'emb': unknown engine option 'bogus'"),
        ({"emb": {"model": "x", "pipeline_parallel_size": 0}}, {}, "model 'emb': pipeline_para"),
        ({"emb": "x"}, {"max_num_seqs": 0}, "model 'ce': max_num_seqs must be >= 1"),
        ({"emb": "x"}, {"model": "y"}, "named in its first argument"),
    ],
)
def test_a_bad_spec_is_refused_before_any_engine_starts(folders, started, models, options, message):
    # A good model first: it must not have started when the bad one is found.
    models = {"ce": folders["ce"], **models} if isinstance(models, dict) and models else models
    with pytest.raises(InvalidInputError, match=message):
        Router(models, **options)
    assert started == []


def test_a_model_that_cannot_be_read_is_refused_before_any_engine_starts(
    folders, started, tmp_path
):
    broken = tmp_path / "not-a-model"
    broken.mkdir()
    with pytest.raises(ModelLoadError, match=r"has no config\.json") as e:
        Router({"ce": folders["ce"], "broken": str(broken), "clf": folders["clf"]})
    assert any("model 'broken'" in note for note in e.value.__notes__)
    assert started == []  # the memory plan reads every model before the first starts


def test_a_failing_start_closes_the_engines_started_before_it(folders, started, tmp_path):
    # Readable for the memory plan (config and weights), but its tokenizer will not load.
    broken = tmp_path / "bad-tokenizer"
    shutil.copytree(folders["ce"], broken)
    (broken / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"cannot load .*tokenizer\.json") as e:
        Router({"ce": folders["ce"], "broken": str(broken), "clf": folders["clf"]})
    assert any("model 'broken'" in note for note in e.value.__notes__)
    assert len(started) == 1  # ce; clf, after the failure, never started
    assert started[0].health == "closed"


def test_close_closes_every_engine_past_an_error(folders, monkeypatch):
    first, second = Engine(folders["ce"]), Engine(folders["clf"])

    def fail() -> None:
        raise RuntimeError("cannot close")

    monkeypatch.setattr(second, "close", fail)  # closed first: engines close in reverse order
    router = Router.from_engines({"ce": first, "clf": second})
    with pytest.raises(RuntimeError, match="cannot close") as e:
        router.close()
    assert any("model 'clf'" in note for note in e.value.__notes__)
    assert first.health == "closed"
    monkeypatch.undo()
    second.close()


def test_every_lazy_export_resolves():
    for name in pipepool.__all__:
        assert getattr(pipepool, name).__name__ == name
