"""``pipepool parity`` on vision-language models (issue 59 part 6): a Qwen2-VL embedder's
texts, texts as dicts, images and texts with images, and ColQwen2's queries, pages and MaxSim,
at PP 1 and 2 with an 8-token budget (an image's placeholder tokens span several steps),
against transformers on the processor's outputs; a reference fed other pixels, or a stage
that loses M-RoPE, fails exactly the rows with images."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_colpali import make_colpali
from tiny_models import MIN_COSINE
from tiny_vlm import make_colqwen2, make_qwen2_vl

import pipepool.parity.vlm_reference
from pipepool.commands.cli import main

# Slow: PP=2 pipelines of stage processes, and transformers' reference.
pytestmark = pytest.mark.slow

BUDGET = "8"
SMALL = ["--max-model-len", "256"]  # caps the built-in text prompts: still several chunks


@pytest.fixture(scope="module")
def vlm_path(model_dir) -> Path:
    return make_qwen2_vl(model_dir / "parity_qwen2_vl")


@pytest.fixture(scope="module")
def colqwen2_path(vlm_path, model_dir) -> Path:
    return make_colqwen2(vlm_path, model_dir / "parity_colqwen2")


@pytest.fixture(scope="module")
def colpali_path(model_dir) -> Path:
    return make_colpali(model_dir / "parity_colpali")


def _parity(args: list[str], tmp_path: Path) -> tuple[int, dict]:
    out = tmp_path / "parity.json"
    rc = main(["parity", *args, "--max-num-batched-tokens", BUDGET, *SMALL, "--json", str(out)])
    return rc, json.loads(out.read_text())


def _other_pixels(monkeypatch) -> None:
    """The transformers reference sees pixel values shifted by 0.05 (the engine does not)."""
    to = pipepool.parity.vlm_reference._to

    def shifted(batch: dict, device, dtype) -> dict:
        moved = to(batch, device, dtype)
        if "pixel_values" in moved:
            moved["pixel_values"] = moved["pixel_values"] + 0.05
        return moved

    monkeypatch.setattr(pipepool.parity.vlm_reference, "_to", shifted)


def test_vlm_embedder_images_and_texts_match_transformers(vlm_path, tmp_path, monkeypatch, capsys):
    rc, report = _parity(["--model", str(vlm_path), "--pp", "1,2", "--pooling", "last"],
                         tmp_path)  # fmt: skip
    assert rc == 0, report["rows"]
    assert report["reference"].startswith("transformers ")
    assert "Qwen2VLModel (Qwen2VLProcessor without videos)" in report["reference"]
    groups = ["text", "text-dict", "image", "text+image"]
    assert [(r["pp"], r["pooling"]) for r in report["rows"]] == [
        (pp, f"{g} last") for pp in (1, 2) for g in groups
    ]
    assert all(r["passed"] and r["min_cosine"] >= MIN_COSINE for r in report["rows"])
    previews = [p["preview"] for p in report["prompts"]]
    assert sum(p.startswith("<image") for p in previews) == 5 + 3  # images, texts with images
    for r in report["rows"]:  # every input took several steps: placeholders span steps
        assert r["chunked"] == r["requests"] or r["pooling"] == "text last"
        if r["pooling"].startswith(("image", "text+image")):
            assert previews[r["worst_request"]].startswith("<image")

    _other_pixels(monkeypatch)
    rc, report = _parity(["--model", str(vlm_path), "--pp", "1", "--pooling", "last"], tmp_path)
    assert rc == 1
    verdict = {r["pooling"]: r["passed"] for r in report["rows"]}
    assert verdict == {"text last": True, "text-dict last": True, "image last": False,
                       "text+image last": False}  # fmt: skip
    capsys.readouterr()
    assert main(["parity", "--model", str(vlm_path), "--max-score-diff", "0.1"]) == 2
    assert "max_score_diff applies to classifiers' scores and page" in capsys.readouterr().err


def test_page_retriever_queries_pages_and_maxsim_match_transformers(
    colqwen2_path, tmp_path, monkeypatch, capsys
):
    rc, report = _parity(["--model", str(colqwen2_path), "--pp", "1,2"], tmp_path)
    assert rc == 0, report["rows"]
    assert "ColQwen2ForRetrieval (ColQwen2Processor)" in report["reference"]
    assert report["max_sim_diff"] == 1e-4
    assert [(r["pp"], r["pooling"]) for r in report["rows"]] == [
        (pp, k) for pp in (1, 2) for k in ("query", "page", "maxsim")
    ]
    for r in report["rows"]:
        assert r["passed"] and r["max_abs_diff"] <= 1e-4
        if r["pooling"] == "maxsim":
            assert r["requests"] == 25 and r["min_cosine"] is None
        else:
            assert r["min_cosine"] >= MIN_COSINE and r["chunked"] == r["requests"]
    capsys.readouterr()
    assert main(["parity", "--model", str(colqwen2_path), "--pooling", "mean"]) == 2
    assert "poolings cannot be chosen" in capsys.readouterr().err

    _other_pixels(monkeypatch)
    rc, report = _parity(["--model", str(colqwen2_path), "--pp", "1"], tmp_path)
    assert rc == 1
    assert {r["pooling"]: r["passed"] for r in report["rows"]} == {
        "query": True, "page": False, "maxsim": False,
    }  # fmt: skip
    assert "FAIL pp=1 tokens=8 maxsim: worst pair #" in capsys.readouterr().out


def test_colpali_runs_each_prompt_whole(colpali_path, tmp_path):
    """ColPali's prompts are bidirectional: below their length, each runs alone in one step
    (nothing chunks), at PP 1 and 2, against ColPaliForRetrieval."""
    rc, report = _parity(["--model", str(colpali_path), "--pp", "1,2"], tmp_path)
    assert rc == 0, report["rows"]
    assert "ColPaliForRetrieval (ColPaliProcessor)" in report["reference"]
    assert min(p["tokens"] for p in report["prompts"]) > int(BUDGET)
    assert [r["pooling"] for r in report["rows"]] == ["query", "page", "maxsim"] * 2
    assert all(r["passed"] and r["chunked"] == 0 for r in report["rows"])


def test_a_stage_applying_text_positions_fails_the_image_rows(vlm_path, tmp_path, monkeypatch):
    """With the lockstep checks off, a second stage that rotates by 1-D positions (as if no
    image were there: M-RoPE lost mid-pipeline) is caught by the vectors themselves: the rows
    with images fail on cosine, the text rows (whose M-RoPE positions are 1-D) pass."""
    import faults

    faults.install(monkeypatch, "text_positions_on_stage", stage=1)
    args = ["--model", str(vlm_path), "--pp", "2", "--pooling", "last", "--no-verify-state"]
    rc, report = _parity(args, tmp_path)
    assert rc == 1
    rows = {r["pooling"]: r for r in report["rows"]}
    assert rows["text last"]["passed"] and rows["text-dict last"]["passed"]
    for key in ("image last", "text+image last"):
        assert rows[key]["error"] is None and rows[key]["min_cosine"] < MIN_COSINE, rows[key]
