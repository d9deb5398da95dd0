"""Issue 58 part 2: ``Engine`` is a thin front class (at most 25 public names, no mixins) whose
facts front ends read from ``engine.info``; sentence-transformers' ``SentenceTransformer`` /
``CrossEncoder`` surfaces and the retrieval one are adapters over it, which own an engine they
start and share one they are given."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import pipepool

MAX_PUBLIC_NAMES = 25


@pytest.fixture(scope="module")
def engine(st_bert_path):
    with pipepool.Engine(str(st_bert_path)) as engine:
        yield engine


def test_engine_has_at_most_25_public_names_and_no_mixins(engine):
    public = sorted(name for name in dir(engine) if not name.startswith("_"))
    assert len(public) <= MAX_PUBLIC_NAMES, f"{len(public)} public names: {public}"
    assert pipepool.Engine.__bases__ == (object,)


def test_info_is_frozen_and_says_what_the_model_is(engine, st_bert_path):
    info = engine.info
    assert info.model_path == str(st_bert_path) and info.model == st_bert_path.name
    assert info.tasks == ("embed",) and info.outputs == ("dense",) and info.classifier is None
    assert info.dimensions == engine.embed(["a"]).shape[1] == 32
    assert info.vocab_size == engine.tokenizer.vocab_size
    assert info.prompt_text("query") == info.prompts["query"] != ""
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.max_model_len = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        info.prompts["query"] = "changed"  # type: ignore[index]
    params = info.pooling_params(dimensions=8)
    assert (params.pooling, params.normalize, params.dimensions) == (info.pooling, True, 8)
    with pytest.raises(pipepool.InvalidInputError, match="larger than the model's embedding"):
        info.pooling_params(dimensions=33)


def test_an_adapter_given_an_engine_shares_it(engine):
    model = pipepool.SentenceTransformer(engine)
    vectors = model.encode(["a text"])
    model.truncate_dim = 8  # the adapter's setting, not the engine's
    assert model.encode(["a text"]).shape == (1, 8)
    with model:
        pass  # leaving the block closes what the adapter owns: not a shared engine
    assert engine.health == "ok"
    np.testing.assert_allclose(pipepool.SentenceTransformer(engine).encode(["a text"]), vectors)
    with pytest.raises(pipepool.InvalidInputError, match="this adapter shares") as info:
        pipepool.SentenceTransformer(engine, device="cpu")
    assert info.value.param == "device"
    with pytest.raises(pipepool.InvalidInputError, match="this Retriever shares"):
        pipepool.Retriever(engine, dtype="float32")


def test_an_adapter_built_from_a_model_owns_its_engine(st_bert_path, engine):
    with pipepool.SentenceTransformer(
        str(st_bert_path), truncate_dim=16, prompts={"title": "title: "}
    ) as model:
        own = model.engine
        assert own is not engine and own.health == "ok"
        assert model.truncate_dim == 16 and model.prompts["title"] == "title: "
        assert model.encode("a text").shape == (16,)
    assert own.health == "closed"
    with pytest.raises(pipepool.InvalidInputError, match="unknown engine option 'model_kwargs'"):
        pipepool.SentenceTransformer(str(st_bert_path), model_kwargs={})


def test_cross_encoder_adapter_takes_max_length_and_activation_fn(cross_encoder_path):
    import torch

    with pipepool.CrossEncoder(
        str(cross_encoder_path), max_length=16, activation_fn=torch.nn.Identity()
    ) as model:
        assert model.max_seq_length == 16 and model.tokenizer.model_max_length == 16
        raw = model.predict([("a query", "a document")])
        engine_raw = model.engine.score("a query", "a document", use_activation=False,
                                        truncate_prompt_tokens=16)  # fmt: skip
        np.testing.assert_allclose(raw, engine_raw, atol=1e-5)
    assert model.engine.health == "closed"


def test_retriever_refuses_outputs_the_model_does_not_give(engine):
    with pytest.raises(pipepool.InvalidInputError, match="does not give sparse outputs"):
        pipepool.Retriever(engine).embed_sparse(["a text"])
