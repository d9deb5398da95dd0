"""Token classification (NER): ``*ForTokenClassification`` logits for every token, from the
last stage, aggregated as transformers' token-classification pipeline does ("none", "simple",
"first"), compared entity by entity with that pipeline on the same weights, at PP=1 and PP=2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import _copy_minilm_tokenizer, _train_unigram, long_prompts

import pipepool

LABELS = ("O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG")
TEXTS = [
    "Angela Merkel met Emmanuel Macron in Berlin, then flew to São Paulo.",
    "The quick brown fox jumps over the lazy dog near Microsoft's HQ in Redmond!",
    *long_prompts()[:3],  # within both models' 512 positions (the pipeline does not truncate)
]
STRATEGIES = ("none", "simple", "first", "average", "max")


def _make(path: Path, family: str) -> Path:
    import transformers

    common = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        initializer_range=0.2, num_labels=len(LABELS),
        id2label=dict(enumerate(LABELS)), label2id={k: i for i, k in enumerate(LABELS)},
    )  # fmt: skip
    torch.manual_seed(0)
    if family == "bert":
        _copy_minilm_tokenizer(path)
        config = transformers.BertConfig(vocab_size=30522, **common)
        model = transformers.BertForTokenClassification(config)
    elif family == "modernbert":  # head (dense, activation, norm) + classifier on every token
        _copy_minilm_tokenizer(path)
        config = transformers.ModernBertConfig(
            vocab_size=30522, pad_token_id=0, cls_token_id=101, sep_token_id=102,
            global_attn_every_n_layers=2, local_attention=16, **common,
        )  # fmt: skip
        model = transformers.ModernBertForTokenClassification(config)
    else:  # XLM-R: a unigram tokenizer with no sub-word marks (the pipeline's fallback rule)
        vocab_size = _train_unigram(path)
        config = transformers.XLMRobertaConfig(
            vocab_size=vocab_size, max_position_embeddings=514, type_vocab_size=1,
            pad_token_id=1, bos_token_id=0, eos_token_id=2, **common,
        )  # fmt: skip
        model = transformers.XLMRobertaForTokenClassification(config)
    model.eval().save_pretrained(str(path))
    return path


@pytest.fixture(scope="module", params=["bert", "xlmr", "modernbert"])
def ner(request, model_dir):
    import transformers

    path = _make(model_dir / f"ner-{request.param}", request.param)
    pipe = transformers.pipeline(
        "token-classification", model=str(path), tokenizer=str(path), device="cpu"
    )
    return path, pipe


def _same(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want), (got, want)
    for g, w in zip(got, want, strict=True):
        assert {k: v for k, v in g.items() if k != "score"} == {
            k: (int(v) if k in ("start", "end", "index") else v)
            for k, v in w.items()
            if k != "score"
        }
        assert abs(g["score"] - float(w["score"])) <= 1e-4


@pytest.mark.parametrize("pp", [1, 2])
def test_entities_match_the_transformers_pipeline(ner, pp):
    path, pipe = ner
    with pipepool.Engine(str(path), pipeline_parallel_size=pp, max_num_batched_tokens=16) as e:
        assert e.info.pooling == "all" and e.info.dimensions == len(LABELS)
        found = 0
        for strategy in STRATEGIES:
            got = e.classify_tokens(TEXTS, aggregation_strategy=strategy)
            for text, entities in zip(TEXTS, got, strict=True):
                want = pipe(text, aggregation_strategy=strategy)
                _same(entities, want)
                found += len(want)
        assert found > 20  # random weights still label plenty of tokens as entities


def test_a_token_classifier_refuses_sequence_tasks_and_bad_options(ner):
    path, _ = ner
    with pipepool.Engine(str(path)) as e:
        with pytest.raises(pipepool.InvalidInputError, match="token classifier"):
            e.classify(["a text"])
        with pytest.raises(pipepool.InvalidInputError, match="token classifier"):
            e.score("a", ["b"])
        with pytest.raises(pipepool.InvalidInputError, match="aggregation_strategy"):
            e.classify_tokens(["a text"], aggregation_strategy="longest")
        assert e.classify_tokens(["still serving"])[0] is not None


def test_other_models_refuse_token_classification(bert_path):
    with (
        pipepool.Engine(str(bert_path)) as e,
        pytest.raises(pipepool.InvalidInputError, match="classif"),
    ):
        e.classify_tokens(["a text"])


def test_pooling_route_answers_each_tokens_label_probabilities(model_dir, tmp_path):
    """vLLM's token_classify over HTTP: ``/pooling`` on a token classifier gives one
    [num_tokens, num_labels] matrix per input, transformers' softmax of the logits."""
    import httpx
    import numpy as np
    import transformers
    from test_server import ServerProcess

    path = _make(model_dir / "ner-server", "bert")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.AutoModelForTokenClassification.from_pretrained(str(path)).eval()
    server = ServerProcess(["--model", str(path)], tmp_path / "server.log").wait_ready()
    try:
        r = httpx.post(server.url + "/pooling", json={"input": TEXTS[:2]}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["id"].startswith("pooling-")  # vLLM's: the model's own task
        body = {"input": TEXTS[:2], "task": "token_classify"}
        asked = httpx.post(server.url + "/pooling", json=body, timeout=60)
        assert asked.json()["data"] == r.json()["data"]
        for text, item in zip(TEXTS[:2], r.json()["data"], strict=True):
            got = np.array(item["data"])
            with torch.no_grad():
                logits = model(**tokenizer(text, return_tensors="pt")).logits[0]
            want = torch.softmax(logits, -1).numpy()
            assert got.shape == want.shape == (len(want), len(LABELS))
            assert np.abs(got - want).max() <= 1e-4
        r = httpx.post(server.url + "/v1/embeddings", json={"input": "a text"}, timeout=60)
        assert r.status_code == 404 and "classify_tokens" in r.json()["error"]["message"]
        body = {"input": "a text", "task": "token_embed"}
        r = httpx.post(server.url + "/pooling", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["message"].endswith(
            "its tasks: token_classify"
        )
    finally:
        server.stop()


def test_ner_command_writes_the_engines_entities(ner, tmp_path, capsys):
    from pipepool.commands.cli import main

    path, pipe = ner
    out = tmp_path / "entities.jsonl"
    assert main(["ner", "--model", str(path), *TEXTS[:2], "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["text"] for r in rows] == TEXTS[:2]
    for row in rows:
        _same(row["entities"], pipe(row["text"], aggregation_strategy="simple"))
    assert main(["ner", "--model", str(path), TEXTS[0]]) == 0
    assert capsys.readouterr().out.startswith("[0] ")
