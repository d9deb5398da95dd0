"""Issue 13 items 3 and 5 on the command line: ``pipepool rerank`` ranks documents as
``Engine.rerank`` does, and ``pipepool parity`` compares a reranker's scores per pair at PP 1
and 2 with chunked prompts, and fails on the historical non-last-stage bug."""

from __future__ import annotations

import json

import faults
import numpy as np
import pytest
from tiny_models import SENTENCES

import pipepool
from pipepool.commands.cli import main
from pipepool.parity.score_sweep import same_order

# Slow: parity of rerankers over PP=2 pipelines.
pytestmark = pytest.mark.slow

QUERY = "How do pipeline stages stay in lockstep?"
DOCUMENTS = SENTENCES[:5]


def test_rerank_command_ranks_like_the_engine(cross_encoder_path, tmp_path, capsys):
    out = tmp_path / "ranked.jsonl"
    args = ["rerank", "--model", str(cross_encoder_path), "--query", QUERY, *DOCUMENTS]
    assert main([*args, "--top-n", "3", "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    with pipepool.Engine(str(cross_encoder_path), device="cpu") as engine:
        expected = engine.rerank(QUERY, DOCUMENTS, top_n=3)
    assert [r["rank"] for r in rows] == [1, 2, 3]
    assert [r["index"] for r in rows] == [e.index for e in expected]
    assert [r["text"] for r in rows] == [DOCUMENTS[e.index] for e in expected]
    assert np.allclose([r["relevance_score"] for r in rows], [e.relevance_score for e in expected])
    assert "ranked 5 documents" in capsys.readouterr().err

    assert main([*args, "--raw-scores"]) == 0  # printed: one line per document, best first
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 5 and printed[0].startswith(f"  1. [{expected[0].index}] ")


def test_rerank_command_refuses_an_embedding_model_and_no_documents(bert_path, capsys):
    assert main(["rerank", "--model", str(bert_path), "--query", QUERY, "a", "b"]) == 2
    assert "embedding model and cannot" in capsys.readouterr().err
    assert main(["rerank", "--model", str(bert_path), "--query", QUERY]) == 2
    assert "no documents to rank" in capsys.readouterr().err


def test_parity_of_a_reranker_pp1_pp2_chunked(qwen3_reranker_path, tmp_path, capsys):
    out = tmp_path / "parity.json"
    args = ["parity", "--model", str(qwen3_reranker_path), "--pp", "1,2"]
    args += ["--max-num-batched-tokens", "16", "--max-model-len", "256", "--json", str(out)]
    assert main(args) == 0, capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["passed"] and report["max_score_diff"] == 1e-4
    assert report["reference"].startswith("transformers 5.17.0 AutoModelForCausalLM")
    assert max(p["tokens"] for p in report["prompts"]) == 256  # pairs up to max_model_len
    for row in report["rows"]:
        assert row["chunked"] == len(report["prompts"])  # every pair is over 16 tokens
        assert row["max_abs_diff"] <= 1e-4 and row["same_order"] is True


def test_parity_of_a_reranker_fails_on_the_historical_bug(qwen3_reranker_path, capsys, monkeypatch):
    faults.install(monkeypatch, "skip_post_step_on_non_last_stage")
    args = ["parity", "--model", str(qwen3_reranker_path), "--pp", "2"]
    args += ["--max-num-batched-tokens", "16", "--max-model-len", "256"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "StateDivergence" in out and "parity FAILED: 0 of 1" in out


def test_parity_of_a_reranker_refuses_a_pooling(cross_encoder_path, capsys):
    """A classifier's head decides what is compared: --pooling is refused, not ignored."""
    args = ["parity", "--model", str(cross_encoder_path), "--pp", "1", "--pooling", "cls"]
    assert main(args) == 2
    assert "poolings cannot be chosen" in capsys.readouterr().err


def test_same_order_allows_swaps_only_within_the_tolerance():
    expected = np.array([0.5, 0.2, 0.20001, -1.0])
    assert same_order(np.array([0.4, 0.20002, 0.2, -2.0]), expected, 1e-4)  # near-tie swapped
    assert not same_order(np.array([0.1, 0.2, 0.3, -2.0]), expected, 1e-4)


def test_parity_of_a_soft_capped_reranker_against_transformers_full_attention(tmp_path, capsys):
    """Gemma2's attention logits are soft-capped; the reference computes that (transformers'
    eager attention: its default sdpa drops the cap), so the float32 bar holds, chunked, PP 2."""
    from tiny_gemma import make_gemma2

    model = make_gemma2(tmp_path / "gemma2-reranker", num_labels=1)
    out = tmp_path / "parity.json"
    args = ["parity", "--model", str(model), "--pp", "1,2", "--max-num-batched-tokens", "16"]
    assert main([*args, "--max-model-len", "128", "--json", str(out)]) == 0, capsys.readouterr()
    report = json.loads(out.read_text())
    assert report["passed"] and report["max_score_diff"] == 1e-4 and report["rule"] is None
    assert report["reference"].startswith("transformers 5.17.0 AutoModelForSequenceClassification")
    assert all(r["chunked"] > 0 and r["max_abs_diff"] <= 1e-4 for r in report["rows"])


def test_bf16_reranker_is_judged_by_transformers_own_bf16_error(
    qwen3_reranker_path, tmp_path, capsys
):
    """docs/design.md §3 carried to raw logits: a bf16 engine against a float32 reference may be
    off by 1.5x transformers' own largest bf16 error on the same pairs + 1e-5."""
    from pipepool.parity.score_sweep import allowed_score_error

    out = tmp_path / "parity.json"
    args = ["parity", "--model", str(qwen3_reranker_path), "--pp", "1"]
    args += ["--max-num-batched-tokens", "16", "--max-model-len", "256", "--dtype", "bfloat16"]
    assert main([*args, "--reference-dtype", "float32", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert f"pass:      {report['rule']} for every pair" in capsys.readouterr().out
    peer_error = float(report["rule"].split("(")[1].split(")")[0])
    assert report["rule"].startswith("|raw logit - reference| <= 1.5 x transformers bfloat16's")
    assert report["max_score_diff"] == pytest.approx(allowed_score_error(peer_error), rel=1e-3)
    assert peer_error > 1e-4  # bf16 rounding: the float32 bar would be the wrong test
    (row,) = report["rows"]
    assert row["passed"] and row["chunked"] > 0 and row["max_abs_diff"] <= report["max_score_diff"]
    assert allowed_score_error(0.0) == 1e-5


def test_parity_says_when_no_document_fits_beside_the_rerankers_prompt(qwen3_reranker_path, capsys):
    args = ["parity", "--model", str(qwen3_reranker_path), "--max-model-len", "64"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "no built-in document fits with the query in max_model_len 64" in err, err
