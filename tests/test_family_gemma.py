"""Gemma2 and Gemma3 text against transformers on the same weights (fp32 CPU): causal models
chunked to a 16-token budget across PP=1 and PP=2 (Gemma2's soft-capped attention over the KV
cache of earlier chunks), bidirectional Gemma3 (EmbeddingGemma) with its symmetric sliding
window, an EmbeddingGemma-shaped sentence-transformers folder, classifiers; and the
refusals of what transformers would not compute the same way."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_gemma import (
    EMBEDDINGGEMMA_PROMPTS,
    gemma_reference,
    make_embeddinggemma_st,
    make_gemma2,
    make_gemma3,
)
from tiny_models import (
    MIN_COSINE,
    SENTENCES,
    Reference,
    assert_triton_graphs_bf16,
    cosine,
    long_prompts,
)

import pipepool

BUDGET = 16
CAUSAL = {"gemma2": True, "gemma3": True, "gemma3-bidirectional": False}


@pytest.fixture(scope="module")
def gemma_paths(model_dir) -> dict[str, Path]:
    return {
        "gemma2": make_gemma2(model_dir / "gemma2"),
        "gemma3": make_gemma3(model_dir / "gemma3", bidirectional=False),
        "gemma3-bidirectional": make_gemma3(model_dir / "gemma3-bidir", bidirectional=True),
    }


@pytest.fixture(scope="module")
def references(gemma_paths) -> dict[str, Reference]:
    return {name: gemma_reference(path) for name, path in gemma_paths.items()}


def _assert_matches(engine, ref: Reference, prompts: list[str], pooling: str) -> None:
    outs = engine.pool(prompts, pooling=pooling, normalize=False)
    for text, out in zip(prompts, outs, strict=True):
        ids = ref.token_ids(text)
        assert [int(t) for t in engine.tokenize([text])[0]] == ids
        worst = float(cosine(out, ref.pooled(ids, pooling)).min())  # per token for "all"
        assert worst >= MIN_COSINE, f"{pooling}, {len(ids)} tokens: cosine {worst}"


@pytest.mark.parametrize("name", list(CAUSAL))
@pytest.mark.parametrize("pp", [1, 2])
def test_gemma_matches_transformers(gemma_paths, references, name, pp):
    ref, prompts = references[name], long_prompts()
    # The longest prompt spans many chunks and many sliding windows (16 keys).
    assert max(len(ref.token_ids(p)) for p in prompts) > 10 * BUDGET
    with pipepool.Engine(
        str(gemma_paths[name]), pipeline_parallel_size=pp, max_num_batched_tokens=BUDGET
    ) as engine:
        assert engine.info.causal == CAUSAL[name]
        for pooling in ("last", "mean", "all"):
            _assert_matches(engine, ref, prompts, pooling)
        if CAUSAL[name]:
            assert engine.stats.chunked_requests > 0
        else:
            assert engine.stats.chunked_requests == 0  # whole prompts: they cannot be chunked


def test_the_references_tell_the_attention_variants_apart(gemma_paths, references, tmp_path):
    """What the test above pins down changes the vectors: transformers' sdpa path (which drops
    the soft-capping) and a bidirectional window one key narrower on each side (sliding_window
    14 instead of 16) both give other ones."""
    ids = references["gemma2"].token_ids(long_prompts()[3])
    uncapped = Reference(gemma_paths["gemma2"])  # sdpa
    assert cosine(uncapped.pooled(ids, "mean"), references["gemma2"].pooled(ids, "mean")) < 0.999
    source = gemma_paths["gemma3-bidirectional"]
    narrower = gemma_reference(_edit_config(source, tmp_path / "narrow", sliding_window=14))
    bidirectional = references["gemma3-bidirectional"]
    assert cosine(narrower.pooled(ids, "mean"), bidirectional.pooled(ids, "mean")) < MIN_COSINE


def test_embeddinggemma_folder_matches_sentence_transformers(model_dir):
    from sentence_transformers import SentenceTransformer

    path = make_embeddinggemma_st(model_dir / "embeddinggemma")
    st = SentenceTransformer(str(path), device="cpu")
    texts = [*SENTENCES[:6], long_prompts()[3]]
    with pipepool.Engine(str(path), max_num_batched_tokens=BUDGET) as engine:
        assert engine.info.pooling == "mean" and not engine.info.causal
        ids = [[int(t) for t in row] for row in engine.tokenize(texts)]
        assert ids == [st.tokenizer(t)["input_ids"] for t in texts]
        for prompt_name in (None, *EMBEDDINGGEMMA_PROMPTS):
            expected = st.encode(texts, prompt_name=prompt_name, convert_to_numpy=True)
            vectors = engine.embed(texts, prompt_name=prompt_name)
            assert vectors.shape == expected.shape == (len(texts), 64)
            assert cosine(vectors, expected).min() >= MIN_COSINE, prompt_name


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_classifier_matches_transformers_logits(model_dir, family):
    import transformers

    folder = model_dir / f"{family}-classifier"
    if family == "gemma2":
        path = make_gemma2(folder, num_labels=3)
    else:
        path = make_gemma3(folder, bidirectional=False, num_labels=3)
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    texts = long_prompts()
    options = dict(pipeline_parallel_size=2, max_num_batched_tokens=BUDGET)
    with pipepool.Engine(str(path), pipeline_backend="inproc", **options) as engine:
        ids = engine.tokenize(texts)
        raw = engine.classify(texts, use_activation=False)
        assert engine.stats.chunked_requests > 0
    with torch.no_grad():
        logits = np.stack([reference(input_ids=torch.as_tensor(i)[None]).logits[0] for i in ids])
    assert np.abs(raw.probs - logits).max() <= 1e-4


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    ("name", "field", "value"),
    [
        # transformers' Gemma3 reads it but never applies it.
        ("gemma3", "attn_logit_softcapping", 50.0),
        # Read by Gemma2's attention layers but not its masks.
        ("gemma2", "use_bidirectional_attention", True),
        # Read by the masks but not the attention layers.
        ("gemma2", "is_causal", False),
        ("gemma3-bidirectional", "is_causal", False),
        ("gemma2", "partial_rotary_factor", 0.5),
    ],
)
def test_fields_transformers_would_not_compute_as_asked_are_refused(
    gemma_paths, tmp_path, name, field, value
):
    path = _edit_config(gemma_paths[name], tmp_path / name, **{field: value})
    with pytest.raises(pipepool.ModelLoadError, match=f"{field}={value!r}"):
        pipepool.Engine(str(path))


def test_a_causal_override_of_embeddinggemma_uses_the_causal_window(gemma_paths, tmp_path):
    """attention='causal' runs the checkpoint as transformers does with
    use_bidirectional_attention false: causal layers, the sliding window not halved."""
    source = gemma_paths["gemma3-bidirectional"]
    causal = _edit_config(source, tmp_path / "causal", use_bidirectional_attention=False)
    ref = gemma_reference(causal)
    with pipepool.Engine(str(source), attention="causal", max_num_batched_tokens=BUDGET) as engine:
        assert engine.info.causal
        _assert_matches(engine, ref, long_prompts()[:5], "mean")
        assert engine.stats.chunked_requests > 0


# -- CUDA (skipped where there is none) -------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", list(CAUSAL))
def test_gpu_fp32_matches_transformers_with_cuda_graphs_where_they_apply(
    gemma_paths, references, name
):
    """The soft-capped and symmetric-window attention on CUDA, CUDA graphs left to the engine
    (on where the model's attention can be captured); asking for graphs on a model whose
    attention reads the step's host offsets is refused by name."""
    options = dict(device="cuda", dtype="float32", compile=False)
    path = str(gemma_paths[name])
    with pipepool.Engine(path, max_num_batched_tokens=BUDGET, **options) as e:
        graphs = e.pipeline.deployment.graph_max_tokens > 0
    if not graphs:
        with pytest.raises(pipepool.InvalidInputError, match="cannot be captured as CUDA graphs"):
            pipepool.Engine(path, max_num_batched_tokens=BUDGET, cuda_graphs=True, **options)
    with pipepool.Engine(path, max_num_batched_tokens=BUDGET, **options) as e:
        for pooling in ("last", "mean", "all"):
            _assert_matches(e, references[name], long_prompts(), pooling)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", list(CAUSAL))
@pytest.mark.parametrize(("compile", "budget"), [(False, BUDGET), (False, 4096), (True, BUDGET)])
def test_gpu_bf16_error_is_no_worse_than_transformers_bf16(
    gemma_paths, references, name, compile, budget
):
    """docs/design.md §3's rule, 1 - cos(engine bf16, fp32 reference) <= 1.5 x (1 - cos(transformers
    bf16, fp32 reference)) + 1e-5, per request for "last" and "mean". Token by token ("all"),
    two bf16 computations of equal accuracy trade places (3-4% of tokens beyond 1.5x here, at a
    mean error below transformers'), so "all" is held to the rule on the mean error over every
    token, and each token to test_gpu.py's bf16 floor."""
    import transformers

    ref, prompts = references[name], long_prompts()
    theirs = transformers.AutoModel.from_pretrained(
        str(gemma_paths[name]), dtype=torch.bfloat16, attn_implementation="eager"
    )
    theirs = theirs.cuda().eval()
    options = dict(device="cuda", dtype="bfloat16", compile=compile)
    with pipepool.Engine(str(gemma_paths[name]), max_num_batched_tokens=budget, **options) as e:
        for pooling in ("last", "mean", "all"):
            outs = e.pool(prompts, pooling=pooling, normalize=False)
            errors = []  # (engine, transformers) per request, or per token for "all"
            for text, out in zip(prompts, outs, strict=True):
                ids = ref.token_ids(text)
                with torch.no_grad():
                    h = theirs(input_ids=torch.tensor([ids], device="cuda")).last_hidden_state
                h = h[0].float().cpu().numpy()
                bf16 = {"last": h[-1], "mean": h.mean(0), "all": h}[pooling]
                want = ref.pooled(ids, pooling)
                errors.append((1 - cosine(out, want), 1 - cosine(bf16, want)))
            ours, hf = (np.concatenate(side) for side in zip(*errors, strict=True))
            if pooling == "all":
                assert ours.max() <= 1 - 0.999, ours.max()
                ours, hf = ours.mean(keepdims=True), hf.mean(keepdims=True)
            assert (ours <= 1.5 * hf + 1e-5).all(), (pooling, ours, hf)


def test_parity_command_applies_gemma2_soft_capping_in_its_reference(gemma_paths, tmp_path):
    """``pipepool parity`` on Gemma2: its transformers reference runs the eager attention, the
    one that applies soft-capping (the default SDPA one ignores it), so every row passes."""
    import json

    from pipepool.commands.cli import main

    out = tmp_path / "parity.json"
    args = ["parity", "--model", str(gemma_paths["gemma2"]), "--pp", "1,2"]
    args += ["--max-num-batched-tokens", "16", "--max-model-len", "128", "--json", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["passed"] and all(r["passed"] and r["chunked"] > 0 for r in report["rows"])


@pytest.mark.gpu
@gpu
def test_gpu_bidirectional_windows_run_in_the_triton_kernel_inside_cuda_graphs(tmp_path):
    """EmbeddingGemma's shape with 32-dim heads, bf16: its windowed layers run in the Triton
    kernel (a symmetric window), inside whole-step CUDA graphs, no less accurate than
    transformers' bf16 (eager attention, as the reference)."""
    path = make_gemma3(tmp_path / "gemma3-bidir32", bidirectional=True, head_dim=32)
    assert_triton_graphs_bf16(
        path, gemma_reference(path), long_prompts(), attn_implementation="eager"
    )


@pytest.mark.gpu
@gpu
def test_gpu_soft_capped_attention_runs_in_the_triton_kernel_between_cuda_graph_pieces(tmp_path):
    """Gemma2's shape with 32-dim heads, bf16: its soft-capped attention runs in the Triton
    kernel between the pieces of the causal stage's CUDA graphs (chunked at budget 64), its
    RoPE and GeGLU in theirs, no less accurate than transformers' bf16 (eager attention, the
    one that soft-caps)."""
    path = make_gemma2(tmp_path / "gemma2-32", head_dim=32)
    assert_triton_graphs_bf16(
        path, gemma_reference(path), long_prompts(), attn_implementation="eager"
    )
    with pipepool.Engine(str(path), device="cuda", dtype="bfloat16") as engine:
        ops = engine.pipeline.runners[0].model.ops  # what the runs above used
        assert ops.fused_qk_rope and ops.fused_geglu
