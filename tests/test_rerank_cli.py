"""Issue 13 items 3 and 5 on the command line: ``pipepool rerank`` ranks documents as
``Engine.rerank`` does, and ``pipepool parity`` compares a reranker's scores per pair at PP 1
and 2 with chunked prompts, and fails on the historical non-last-stage bug."""

from __future__ import annotations

import json

import faults
import numpy as np
from tiny_models import SENTENCES

import pipepool
from pipepool.commands.cli import main
from pipepool.parity.score_sweep import same_order

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


def test_same_order_allows_swaps_only_within_the_tolerance():
    expected = np.array([0.5, 0.2, 0.20001, -1.0])
    assert same_order(np.array([0.4, 0.20002, 0.2, -2.0]), expected, 1e-4)  # near-tie swapped
    assert not same_order(np.array([0.1, 0.2, 0.3, -2.0]), expected, 1e-4)
