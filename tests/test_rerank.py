"""Issue 13: cross-encoders, Qwen3-Reranker and sequence classifiers through the engine, per
pair against sentence-transformers' CrossEncoder / transformers on the same weights (fp32 on
the CPU), at PP 1 and 2 (processes over gloo), with token budgets small enough that decoder
prompts are chunked; the ranking order must be identical."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from tiny_models import SENTENCES, Qwen3RerankerReference, long_prompts

import pipepool
from pipepool.errors import InvalidInputError, PromptTooLongError
from pipepool.loading.classifier import read_classifier
from pipepool.loading.model_folder import read_model_folder

TOLERANCE = 1e-4  # per pair, fp32
QUERY = "What does a pipeline stage keep for each request it serves?"
# Mixed lengths: one word up to well past BERT's 512 positions (truncated longest-first; it
# starts unlike the others, so no two documents are the same once truncated: exact ties would
# leave the ranking order to float rounding).
DOCUMENTS = [*long_prompts(), *SENTENCES[4:8], " ".join(reversed(SENTENCES))]
QWEN3_MAX_LEN = 480  # the longest documents are truncated to fit, as the model card does


def engine_options(pp: int, budget: int) -> dict:
    return {"pipeline_parallel_size": pp, "max_num_batched_tokens": budget, "device": "cpu"}


# -- cross-encoders against sentence-transformers --------------------------------------------


@pytest.fixture(scope="module", params=["ms-marco", "bge"])
def cross_encoder(request, cross_encoder_path, xlmr_reranker_path):
    """(folder, CrossEncoder scores raw, activated, its ranking)."""
    from sentence_transformers import CrossEncoder

    path = cross_encoder_path if request.param == "ms-marco" else xlmr_reranker_path
    model = CrossEncoder(str(path), device="cpu")
    pairs = [(QUERY, d) for d in DOCUMENTS]
    raw = model.predict(pairs, activation_fn=torch.nn.Identity(), show_progress_bar=False)
    activated = model.predict(pairs, show_progress_bar=False)
    ranking = [r["corpus_id"] for r in model.rank(QUERY, DOCUMENTS)]
    return path, raw, activated, ranking


@pytest.mark.parametrize("pp,budget", [(1, 64), (2, 16)])
def test_cross_encoder_scores_match_sentence_transformers_per_pair(cross_encoder, pp, budget):
    path, raw, activated, ranking = cross_encoder
    with pipepool.Engine(str(path), **engine_options(pp, budget)) as engine:
        got_raw = engine.score(QUERY, DOCUMENTS, use_activation=False)
        got = engine.score(QUERY, DOCUMENTS)
        ranked = engine.rerank(QUERY, DOCUMENTS)
    assert np.abs(got_raw - raw).max() <= TOLERANCE
    assert np.abs(got - activated).max() <= TOLERANCE
    assert [r.index for r in ranked] == ranking
    assert [r.relevance_score for r in ranked] == sorted(got.tolist(), reverse=True)


def test_bert_pairs_carry_token_types_to_the_model(cross_encoder_path):
    """The second text of a BERT pair is token type 1; scored with type 0 throughout, this
    checkpoint gives other scores, so the parity above depends on the types arriving."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(cross_encoder_path))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(cross_encoder_path), dtype=torch.float32
    ).eval()
    features = tokenizer([QUERY], [DOCUMENTS[1]], return_tensors="pt")
    assert features["token_type_ids"].any()
    with torch.no_grad():
        typed = model(**features).logits.item()
        untyped = model(
            input_ids=features["input_ids"],
            token_type_ids=torch.zeros_like(features["token_type_ids"]),
        ).logits.item()
    with pipepool.Engine(str(cross_encoder_path), device="cpu") as engine:
        (got,) = engine.score(QUERY, DOCUMENTS[1:2], use_activation=False)
    assert abs(typed - untyped) > 100 * TOLERANCE
    assert abs(got - typed) <= TOLERANCE


def test_rerank_top_n_documents_and_max_tokens_per_doc(cross_encoder_path):
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(cross_encoder_path))
    # Cohere's max_tokens_per_doc: each document keeps its first N tokens.
    cut = []
    for doc in DOCUMENTS:
        offsets = tokenizer(doc, add_special_tokens=False, return_offsets_mapping=True)
        spans = offsets["offset_mapping"]
        cut.append(doc if len(spans) <= 5 else doc[: spans[4][1]])
    reference = CrossEncoder(str(cross_encoder_path), device="cpu")
    expected = reference.rank(QUERY, cut, top_k=3, return_documents=True)
    with pipepool.Engine(str(cross_encoder_path), device="cpu") as engine:
        got = engine.rerank(QUERY, DOCUMENTS, top_n=3, return_documents=True, max_tokens_per_doc=5)
        everything = engine.rerank(QUERY, DOCUMENTS, top_n=0)
    assert [r.index for r in got] == [e["corpus_id"] for e in expected]
    assert [r.document for r in got] == [DOCUMENTS[e["corpus_id"]] for e in expected]
    for r, e in zip(got, expected, strict=True):
        assert abs(r.relevance_score - e["score"]) <= TOLERANCE
    assert len(everything) == len(DOCUMENTS) and everything[0].document is None


# -- Qwen3-Reranker against its model card ----------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_reference(qwen3_reranker_path) -> Qwen3RerankerReference:
    return Qwen3RerankerReference(qwen3_reranker_path, max_length=QWEN3_MAX_LEN)


@pytest.mark.parametrize("pp,budget", [(1, 16), (2, 32)])
def test_qwen3_reranker_matches_its_model_card_per_pair_chunked(
    qwen3_reranker_path, qwen3_reference, pp, budget
):
    probs, logits = qwen3_reference.scores(QUERY, DOCUMENTS)
    instruction = "Given a question, find the passage that answers it"
    custom, _ = qwen3_reference.scores(QUERY, DOCUMENTS[:3], instruction)
    options = engine_options(pp, budget)
    with pipepool.Engine(str(qwen3_reranker_path), max_model_len=QWEN3_MAX_LEN, **options) as e:
        got = e.score(QUERY, DOCUMENTS)
        got_logits = e.score(QUERY, DOCUMENTS, use_activation=False)
        got_custom = e.score(QUERY, DOCUMENTS[:3], instruction=instruction)
        ranked = e.rerank(QUERY, DOCUMENTS)
        chunked = e.stats.chunked_requests
        token_ids = e._scorer._pair_encoder.encode([QUERY], DOCUMENTS[-1:], limit=QWEN3_MAX_LEN)
    assert chunked >= len(DOCUMENTS)  # every prompt is longer than the budget
    assert token_ids.token_ids.tolist() == qwen3_reference.token_ids(QUERY, DOCUMENTS[-1])
    assert len(token_ids.token_ids) == QWEN3_MAX_LEN  # the long document was truncated
    assert np.abs(got - probs).max() <= TOLERANCE
    assert np.abs(got_logits - logits).max() <= TOLERANCE
    assert np.abs(got_custom - custom).max() <= TOLERANCE
    assert [r.index for r in ranked] == np.argsort(-probs, kind="stable").tolist()


def test_qwen3_reranker_matches_cross_encoder_with_its_chat_template(qwen3_reranker_path):
    """sentence-transformers' CrossEncoder reads a causal reranker through a chat template with
    query and document roles (pairs.QWEN3_CHAT_TEMPLATE in the folder): the same scores."""
    from sentence_transformers import CrossEncoder

    documents = DOCUMENTS[:6]
    reference = CrossEncoder(str(qwen3_reranker_path), device="cpu")
    expected = reference.predict([(QUERY, d) for d in documents], show_progress_bar=False)
    with pipepool.Engine(str(qwen3_reranker_path), device="cpu") as engine:
        got = engine.score(QUERY, documents)
    assert np.abs(got - expected).max() <= TOLERANCE


def test_qwen3_reranker_reads_only_the_yes_and_no_rows(qwen3_reranker_path):
    with pipepool.Engine(str(qwen3_reranker_path), device="cpu") as engine:
        head = engine.info.classifier
        runner = engine.pipeline.runners[-1]
        rows = runner.model.score_head.rows
    vocab = json.loads((qwen3_reranker_path / "tokenizer.json").read_text())["model"]["vocab"]
    assert head.kind == "yes_no" and head.token_rows == (vocab["yes"], vocab["no"])
    assert head.rows_from == "embed_tokens.weight"  # Qwen3-Reranker-0.6B ties its LM head
    assert tuple(rows.shape) == (2, 64)


# -- decoder sequence classifiers against transformers ----------------------------------------


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama", "mistral"])
def test_decoder_sequence_classifier_matches_transformers_chunked(model_dir, family):
    import tiny_models
    import transformers

    path = tiny_models.make_decoder_classifier(model_dir / f"{family}-classifier", family)
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(path), dtype=torch.float32
    ).eval()
    texts = long_prompts()
    # Two stages in one process: the head runs on the last one, prompts chunked to 16 tokens.
    options = {**engine_options(2, 16), "pipeline_backend": "inproc"}
    with pipepool.Engine(str(path), **options) as engine:
        ids = engine.tokenize(texts)
        result = engine.classify(texts)
        raw = engine.classify(texts, use_activation=False)
        chunked = engine.stats.chunked_requests
        with pytest.raises(InvalidInputError, match="3 labels"):  # no single score to rank by
            engine.rerank(QUERY, texts)
    with torch.no_grad():
        logits = np.stack([reference(input_ids=torch.tensor(i[None])).logits[0] for i in ids])
    assert chunked > 0
    assert np.abs(raw.probs - logits).max() <= TOLERANCE
    assert np.abs(result.probs - torch.softmax(torch.from_numpy(logits), -1).numpy()).max() <= (
        TOLERANCE
    )
    assert result.label_names == ("class-0", "class-1", "class-2")
    assert result.labels == [f"class-{i}" for i in logits.argmax(1)]


# -- the activation a checkpoint names ----------------------------------------------------------


@pytest.mark.parametrize(
    "where,value,expected",
    [
        (None, None, "sigmoid"),
        ("config.json", "torch.nn.modules.activation.Tanh", "tanh"),
        ("legacy", "torch.nn.modules.linear.Identity", "identity"),
        ("config_sentence_transformers.json", "torch.nn.modules.activation.Sigmoid", "sigmoid"),
    ],
)
def test_activation_is_the_one_sentence_transformers_reads(
    cross_encoder_path, tmp_path, where, value, expected
):
    folder = tmp_path / "model"
    shutil.copytree(cross_encoder_path, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["sentence_transformers"]
    if where == "config.json":
        config["sentence_transformers"] = {"activation_fn": value}
    elif where == "legacy":
        config["sbert_ce_default_activation_function"] = value
    elif where is not None:
        (folder / where).write_text(json.dumps({"activation_fn": value}))
        config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (folder / "config.json").write_text(json.dumps(config))
    head = read_classifier(
        read_model_folder(folder), family="bert", decoder=False, head_kind="bert",
        reranker="auto",
        checkpoint_names=(), model_name=None,
    )  # fmt: skip
    assert head.activation == expected and head.labels == ("LABEL_0",)


# -- bad input ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def classifier(cross_encoder_path):
    with pipepool.Engine(str(cross_encoder_path), device="cpu", max_model_len=64) as engine:
        yield engine


@pytest.mark.parametrize(
    "call,param,says",
    [
        (lambda e: e.rerank(QUERY, []), "documents", "documents is empty"),
        (lambda e: e.rerank(QUERY, ["a"], top_n=-1), "top_n", "non-negative"),
        (lambda e: e.rerank(["a", "b"], ["a"]), "query", "query must be a string"),
        (lambda e: e.score(["a", "b"], ["a", "b", "c"]), "text_1", "give one text_1"),
        (lambda e: e.score("a", ["b", 3]), "text_2", "list of strings"),
        (lambda e: e.score("a", "b", instruction="x"), "instruction", "Qwen3-Reranker"),
        (lambda e: e.score("a", "b", long_inputs="chunk"), "long_inputs", "whole input"),
        (lambda e: e.rerank("a", ["b"], max_tokens_per_doc=0), "max_tokens_per_doc", "positive"),
        (lambda e: e.score("a", "b", truncation_side="up"), "truncation_side", "'left'"),
        (lambda e: e.classify("a", truncation_side="up"), "truncation_side", "'left'"),
        (lambda e: e.rerank("a", ["b"], max_chunks_per_doc=0), "max_chunks_per_doc", "positive"),
        (lambda e: e.embed(["a"]), "model", "not an embedding model"),
        (
            lambda e: pipepool.SentenceTransformer(e).encode(["a"]),
            "model",
            "use score, rerank or classify",
        ),
    ],
)
def test_bad_scoring_input_names_the_problem(classifier, call, param, says):
    with pytest.raises(InvalidInputError, match=says) as caught:
        call(classifier)
    assert caught.value.param == param
    assert classifier.score("a", "b").shape == (1,)  # and the engine keeps serving


def test_over_long_pair_is_refused_when_asked_and_truncated_by_default(classifier):
    long = " ".join(SENTENCES)
    with pytest.raises(PromptTooLongError, match="max_model_len=64"):
        classifier.score(QUERY, long, long_inputs="error")
    assert classifier.score(QUERY, long).shape == (1,)


def test_an_embedding_model_cannot_rerank_score_or_classify(bert_path):
    with pipepool.Engine(str(bert_path), device="cpu") as engine:
        for call in (
            lambda: engine.rerank(QUERY, ["a"]),
            lambda: engine.score(QUERY, "a"),
            lambda: engine.classify("a"),
        ):
            with pytest.raises(InvalidInputError, match="embedding model and cannot"):
                call()


def test_score_head_activates_only_the_rows_that_ask_in_a_mixed_step():
    """Requests of one step may differ in use_activation: the head applies the activation
    per row, with the per-row flags uploaded for the step (stage/heads.py)."""
    from pipepool.models.score_heads import LinearScore
    from pipepool.stage.heads import HeadParams, ScoreHead

    module = LinearScore(4, 3)
    torch.nn.init.normal_(module.score.weight)
    head = ScoreHead(module, "softmax")
    x = torch.randn(3, 4)
    logits = module(x)
    mixed = HeadParams(np.zeros(3, np.int64), np.array([True, False, True]))
    _, use_t = (torch.from_numpy(a) for a in mixed.upload_arrays())  # (dims, activation)
    out = head(x, mixed, use_t)
    torch.testing.assert_close(out[1], logits[1])
    torch.testing.assert_close(out[[0, 2]], torch.softmax(logits[[0, 2]], dim=-1))
    uniform = HeadParams(np.zeros(3, np.int64), np.zeros(3, bool))
    torch.testing.assert_close(head(x, uniform, None), logits)  # all raw: no upload needed
