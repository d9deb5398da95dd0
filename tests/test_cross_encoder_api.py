"""Issue 38 item 4: ``pipepool.CrossEncoder``, an adapter over the Engine, offers
``CrossEncoder``'s ``predict`` / ``rank`` surface with its semantics. One script of calls runs
through ``sentence_transformers.CrossEncoder`` and through ours on the same reranker folder;
every result has the same container type, dtype and shape, scores within 1e-4, rankings in the
same order."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tiny_models import SENTENCES

import pipepool

SCORE_TOLERANCE = 1e-4
QUERY = SENTENCES[0]
DOCUMENTS = SENTENCES[1:7]
LONG = " ".join(SENTENCES)  # pairs with it are truncated longest-first at max_seq_length
PAIRS = [(QUERY, d) for d in DOCUMENTS] + [("", DOCUMENTS[0]), (QUERY, ""), (QUERY, LONG)]


def make_nli_cross_encoder(path: Path) -> Path:
    """A three-label BERT cross-encoder with no sentence-transformers activation in its config
    (NLI cross-encoders' shape): CrossEncoder's default there is Identity."""
    import transformers
    from tiny_models import _copy_minilm_tokenizer

    _copy_minilm_tokenizer(path)
    config = transformers.BertConfig(
        vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_labels=3, initializer_range=0.1,
        architectures=["BertForSequenceClassification"],
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(config).eval().save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def nli_path(model_dir) -> Path:
    path = model_dir / "nli-cross-encoder"
    return path if path.exists() else make_nli_cross_encoder(path)


@pytest.fixture(
    scope="module", params=["ms-marco (identity)", "bge (sigmoid)", "qwen3", "nli (3 labels)"]
)
def folder(request, cross_encoder_path, xlmr_reranker_path, qwen3_reranker_path, nli_path):
    return {
        "ms-marco (identity)": cross_encoder_path,
        "bge (sigmoid)": xlmr_reranker_path,
        "qwen3": qwen3_reranker_path,
        "nli (3 labels)": nli_path,
    }[request.param]


@pytest.fixture(scope="module")
def reference(folder):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(folder), device="cpu")


@pytest.fixture(scope="module")
def ours(folder):
    """pipepool's CrossEncoder, with the Engine it builds and owns."""
    with pipepool.CrossEncoder(str(folder)) as model:
        yield model


# The script: each call as a function of the model (either CrossEncoder).
SCRIPT: dict[str, Callable[[Any], Any]] = {
    "predict": lambda m: m.predict(PAIRS),
    "one pair": lambda m: m.predict(PAIRS[0]),
    "one pair as a list": lambda m: m.predict(list(PAIRS[0])),
    "pairs as lists": lambda m: m.predict([list(p) for p in PAIRS]),
    "pairs as a string array": lambda m: m.predict(np.array(PAIRS[:3])),
    "apply_softmax": lambda m: m.predict(PAIRS, apply_softmax=True),
    "activation_fn Identity": lambda m: m.predict(PAIRS, activation_fn=torch.nn.Identity()),
    "activation_fn Tanh": lambda m: m.predict(PAIRS, activation_fn=torch.nn.Tanh()),
    "legacy activation_fct": lambda m: m.predict(PAIRS, activation_fct=torch.nn.Sigmoid()),
    "convert_to_tensor": lambda m: m.predict(PAIRS, convert_to_tensor=True),
    "convert_to_numpy False": lambda m: m.predict(PAIRS, convert_to_numpy=False),
    "batch_size, progress bar, device": lambda m: m.predict(
        PAIRS, batch_size=2, show_progress_bar=True, device="cpu"
    ),
    "num_labels": lambda m: m.num_labels,
    "max_seq_length": lambda m: m.max_seq_length,
    "device": lambda m: m.device,
    "prompts": lambda m: m.prompts,
    "activation_fn": lambda m: type(m.activation_fn).__name__,
}
RANKS: dict[str, Callable[[Any], Any]] = {
    "rank": lambda m: m.rank(QUERY, DOCUMENTS),
    "rank top_k documents": lambda m: m.rank(QUERY, DOCUMENTS, top_k=3, return_documents=True),
    "rank top_k 0": lambda m: m.rank(QUERY, DOCUMENTS, top_k=0),
    "rank softmax": lambda m: m.rank(QUERY, DOCUMENTS, apply_softmax=True),
    "rank raw": lambda m: m.rank(QUERY, DOCUMENTS, activation_fn=torch.nn.Identity()),
    "rank no documents": lambda m: m.rank(QUERY, []),
    "rank legacy convert_to_numpy": lambda m: m.rank(QUERY, DOCUMENTS, convert_to_numpy=True),
}


@pytest.mark.parametrize("call", list(SCRIPT))
def test_script_matches_cross_encoder(ours, reference, call):
    assert_same(SCRIPT[call](ours), SCRIPT[call](reference), call)


@pytest.mark.parametrize("call", list(RANKS))
def test_rank_matches_cross_encoder(ours, reference, call):
    if reference.num_labels != 1:
        with pytest.raises(pipepool.InvalidInputError, match="only works for models with num_"):
            RANKS[call](ours)
        return
    got, want = RANKS[call](ours), RANKS[call](reference)
    assert [r.keys() for r in got] == [r.keys() for r in want]
    assert [r["corpus_id"] for r in got] == [r["corpus_id"] for r in want]
    assert [r.get("text") for r in got] == [r.get("text") for r in want]
    assert all(type(r["score"]) is float for r in got)
    scores = [r["score"] for r in got], [r["score"] for r in want]
    np.testing.assert_allclose(*scores, atol=SCORE_TOLERANCE, rtol=0)


def test_prompt_goes_before_the_first_text_as_in_cross_encoder(ours, reference):
    call = "predict with a prompt"
    if ours.engine.info.classifier.template != "pair":  # Qwen3-Reranker: its own prompt
        with pytest.raises(pipepool.InvalidInputError, match="instruction="):
            ours.predict(PAIRS, prompt="Judge: ")
        return
    assert_same(
        ours.predict(PAIRS, prompt="Judge: "), reference.predict(PAIRS, prompt="Judge: "), call
    )


def test_max_seq_length_set_truncates_as_cross_encoder(ours, reference):
    original = ours.max_seq_length
    assert original == reference.max_seq_length
    try:
        ours.max_seq_length = reference.max_seq_length = 96
        assert_same(ours.predict(PAIRS), reference.predict(PAIRS), "predict, shorter")
    finally:
        ours.max_seq_length = reference.max_seq_length = original


def test_activation_fn_set_by_the_caller_applies_as_in_cross_encoder(ours, reference):
    original = reference.activation_fn
    try:
        ours.activation_fn = reference.activation_fn = torch.nn.Tanh()
        assert_same(ours.predict(PAIRS), reference.predict(PAIRS), "predict with Tanh")
    finally:
        ours.activation_fn, reference.activation_fn = None, original
    assert type(ours.activation_fn) is type(original)


def test_no_pairs_give_no_scores(ours, reference):
    empty = ours.predict([], convert_to_tensor=True)
    labels = ours.num_labels
    # As CrossEncoder for one label; for several, [0, num_labels] (it gives [0] there), and
    # float32 NumPy where it gives a float64 [0] array: shapes that stack with other results.
    assert empty.dtype == torch.float32 and tuple(empty.shape) == ((0,) if labels == 1 else (0, 3))
    if labels == 1:
        assert_same(empty, reference.predict([], convert_to_tensor=True), "no pairs")
    assert ours.predict([]).dtype == np.float32 and ours.predict([], convert_to_numpy=False) == []


def assert_same(got: Any, want: Any, what: str) -> None:
    """Same container type, dtype and shape; scores within SCORE_TOLERANCE; anything else
    equal."""
    assert type(got) is type(want), f"{what}: {type(got).__name__} for {type(want).__name__}"
    if isinstance(want, list):
        assert len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{what}[{i}]")
        return
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, what
        got, want = got.numpy(), want.numpy()
    if isinstance(want, (np.ndarray, np.floating)):
        assert got.dtype == want.dtype and got.shape == want.shape, what
        np.testing.assert_allclose(got, want, atol=SCORE_TOLERANCE, rtol=0, err_msg=what)
        return
    assert got == want, what


def test_cross_encoder_engine_kinds_agree(cross_encoder_path, engine_kind):
    """The surface on stage processes and replicas as well."""
    from sentence_transformers import CrossEncoder

    reference = CrossEncoder(str(cross_encoder_path), device="cpu")
    with pipepool.CrossEncoder(str(cross_encoder_path), **engine_kind) as ours:
        for call in (
            "predict",
            "one pair",
            "convert_to_tensor",
            "batch_size, progress bar, device",
        ):
            assert_same(SCRIPT[call](ours), SCRIPT[call](reference), call)
        got, want = ours.rank(QUERY, DOCUMENTS), reference.rank(QUERY, DOCUMENTS)
        assert [r["corpus_id"] for r in got] == [r["corpus_id"] for r in want]


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda e: e.predict(PAIRS, device="cuda"), "this engine runs on cpu"),
        (lambda e: e.predict(PAIRS, pool={}), "multi-process pool"),
        (lambda e: e.predict([("a", "b", "c")]), "input 0 is not a pair of two texts"),
        (lambda e: e.predict([("a", 1)]), "input 0 is not a pair of two texts"),
        (lambda e: e.predict(PAIRS, batch_size=-1), "batch_size must be a positive integer"),
        (lambda e: e.predict(PAIRS, prompt_name="query"), "Prompt name 'query' not found"),
        (lambda e: e.predict(PAIRS, bogus=True), r"does not use: \['bogus'\]"),
        (lambda e: e.rank(QUERY, DOCUMENTS, bogus=True), r"does not use: \['bogus'\]"),
    ],
)
def test_bad_predict_calls_raise_value_errors_naming_the_problem(cross_encoder_path, call, says):
    with (
        pipepool.CrossEncoder(str(cross_encoder_path)) as ours,
        pytest.raises(pipepool.InvalidInputError, match=says) as info,
    ):
        call(ours)
    assert isinstance(info.value, ValueError)


def test_an_embedding_model_has_no_cross_encoder_surface(bert_path):
    with pipepool.CrossEncoder(str(bert_path)) as ours:
        with pytest.raises(pipepool.InvalidInputError, match="is an embedding model"):
            ours.predict([("a", "b")])
        with pytest.raises(pipepool.InvalidInputError, match="is an embedding model"):
            ours.rank("a", ["b"])
