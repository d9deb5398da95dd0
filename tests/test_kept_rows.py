"""The last stage of a decoder computes its last layer's work after attention for the rows its
pooler reads alone (``StepInputs.keep_rows``): LAST and CLS steps keep their picks, a step that
picks nothing (every prompt mid-way) keeps one row, a step with a MEAN or ALL request keeps
every row; the vectors are the reference's, and the same as with every row computed."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_gemma import gemma_reference, make_gemma2
from tiny_models import MIN_COSINE, cosine, long_prompts

import pipepool
from pipepool.models.decoder import DecoderStage
from pipepool.models.gemma import GemmaStage


def _record_kept(runner) -> list[int | None]:
    """Wrap the runner's forward; the list fills with each step's kept row count (None: all)."""
    kept: list[int | None] = []
    forward = runner.forward

    def recording(x, inputs, kv):
        keep = inputs.keep_rows
        kept.append(None if keep is None else int(keep.shape[0]))
        out = forward(x, inputs, kv)
        assert out.shape[0] == (x.shape[0] if keep is None else keep.shape[0])
        return out

    runner.forward = recording
    return kept


@pytest.fixture(scope="module")
def gemma2_path(model_dir):
    return make_gemma2(model_dir / "gemma2-kept")


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
@pytest.mark.parametrize("pp", [1, 2])
def test_kept_rows_give_the_reference_vectors(
    decoder_paths, gemma2_path, reference, monkeypatch, family, pp
):
    path = gemma2_path if family == "gemma2" else decoder_paths[family]
    ref = gemma_reference(path) if family == "gemma2" else reference(path)
    prompts = long_prompts()
    assert max(len(ref.token_ids(p)) for p in prompts) > 16, "the budget must chunk prompts"
    options = dict(max_num_batched_tokens=16, pipeline_parallel_size=pp)
    if pp == 2:
        options["pipeline_backend"] = "inproc"
    got = {}
    for keeps in (True, False):
        monkeypatch.setattr(DecoderStage, "keeps_rows", keeps)
        monkeypatch.setattr(GemmaStage, "keeps_rows", keeps)
        with pipepool.Engine(str(path), **options) as engine:
            kept = _record_kept(engine.pipeline.runners[-1])
            got[keeps] = {
                p: engine.pool(prompts, pooling=p, normalize=False) for p in ("last", "cls")
            }
            picked_steps = len(kept)
            means = engine.submit(prompts[-3:], pooling="mean", normalize=False)
            lasts = engine.submit(prompts[:-3], pooling="last", normalize=False)
            mixed = list(lasts.result()) + list(means.result())
            for text, out, pooling in zip(
                prompts, mixed, ["last"] * (len(prompts) - 3) + ["mean"] * 3, strict=True
            ):
                want = ref.pooled(ref.token_ids(text), pooling)
                assert float(cosine(out, want).min()) >= MIN_COSINE, (pooling, text[:30])
            if keeps:
                picks = kept[:picked_steps]
                assert None not in picks, "every step of LAST / CLS prompts keeps its picks"
                assert 1 in picks and max(picks) > 1, picks  # mid-way steps and several picks
                assert None in kept[picked_steps:], "a MEAN request's steps keep every row"
            else:
                assert set(kept) == {None}
    for pooling in ("last", "cls"):
        for text, a, b in zip(prompts, got[True][pooling], got[False][pooling], strict=True):
            want = ref.pooled(ref.token_ids(text), pooling)
            assert float(cosine(a, want).min()) >= MIN_COSINE, (pooling, text[:30])
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
