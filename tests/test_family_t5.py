"""The T5 encoder family (sentence-t5, gtr-t5): tiny T5 encoders against transformers'
T5EncoderModel at PP=1 and PP=2 with a budget that the long prompts exceed, a sentence-t5-shaped
sentence-transformers folder against SentenceTransformer.encode, and the config fields and
checkpoints the family does not implement refused by name."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import MIN_COSINE, SENTENCES, cosine, long_prompts
from tiny_t5 import VARIANTS, T5Reference, make_sentence_t5, make_t5

import pipepool
from pipepool.layers import relative_attention
from pipepool.layers.relative_attention import RelativePositionBias

BUDGET = 16
POOLINGS = ("mean", "all", "cls")  # cls: the first token's row (T5 has no [CLS])


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("t5")


@pytest.fixture(scope="module")
def t5_paths(t5_dir) -> dict[str, Path]:
    return {v: make_t5(t5_dir / v, v) for v in VARIANTS}


@pytest.fixture(scope="module")
def t5_refs(t5_paths) -> dict[str, T5Reference]:
    return {v: T5Reference(p) for v, p in t5_paths.items()}


def _assert_matches(engine, ref: T5Reference, prompts: list[str]) -> None:
    for text in prompts:
        assert [int(t) for t in engine.tokenize([text])[0]] == ref.token_ids(text)
    for pooling in POOLINGS:
        outs = engine.pool(prompts, pooling=pooling, normalize=False)
        for text, out in zip(prompts, outs, strict=True):
            expected = ref.pooled(ref.token_ids(text), pooling)
            assert out.shape == expected.shape
            worst = float(cosine(out, expected).min())  # per token for "all"
            assert worst >= MIN_COSINE, f"{pooling}, {len(expected)} rows: cosine {worst}"


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_t5_encoder_matches_transformers(t5_paths, t5_refs, variant, pp):
    ref, prompts = t5_refs[variant], long_prompts()
    assert max(len(ref.token_ids(p)) for p in prompts) > 10 * BUDGET
    path = t5_paths[variant]
    with pipepool.Engine(str(path), pipeline_parallel_size=pp, max_num_batched_tokens=BUDGET) as e:
        # No [CLS] to read: a bare T5 folder pools the mean by default.
        assert e.info.pooling == "mean"
        _assert_matches(e, ref, prompts)


def test_t5_for_conditional_generation_runs_its_encoder(t5_dir):
    path = make_t5(t5_dir / "t5-seq2seq", "gated-gelu", architecture="T5ForConditionalGeneration")
    names = load_file(str(path / "model.safetensors")).keys()
    assert any(n.startswith("decoder.") for n in names)
    with pipepool.Engine(str(path), pipeline_parallel_size=2, max_num_batched_tokens=BUDGET) as e:
        _assert_matches(e, T5Reference(path), long_prompts()[:5])


def test_sentence_t5_folder_matches_sentence_transformers(t5_dir):
    from sentence_transformers import SentenceTransformer

    path = make_sentence_t5(t5_dir / "sentence-t5")
    assert "shared.weight" not in load_file(str(path / "model.safetensors"))
    st = SentenceTransformer(str(path), device="cpu")
    texts = [*long_prompts(), *SENTENCES[:8]]
    expected = st.encode(texts, convert_to_numpy=True)
    with pipepool.Engine(str(path), max_num_batched_tokens=BUDGET) as engine:
        d = engine.pipeline.deployment
        assert (d.pooling, d.normalize, d.output_dim, d.max_model_len) == ("mean", True, 32, 256)
        for text in texts:  # longer prompts truncated as sentence-transformers truncates them
            want = st.tokenizer(text, truncation=True, max_length=256)["input_ids"]
            assert [int(t) for t in engine.tokenize([text])[0]] == want
        vectors = engine.embed(texts)
    assert vectors.shape == expected.shape == (len(texts), 32)
    assert cosine(vectors, expected).min() >= MIN_COSINE


@pytest.mark.parametrize("length", [1, 7, 300])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_relative_position_bias_matches_transformers(t5_paths, t5_refs, variant, length):
    attention = t5_refs[variant].model.encoder.block[0].layer[0].SelfAttention
    hf = json.loads((t5_paths[variant] / "config.json").read_text())
    table = RelativePositionBias(
        hf["relative_attention_num_buckets"], hf["relative_attention_max_distance"], 4
    )
    table.weight = torch.nn.Parameter(attention.relative_attention_bias.weight.detach().clone())
    table.reset_buffers()
    with torch.no_grad():
        assert torch.equal(table(length), attention.compute_bias(length, length))


@pytest.mark.parametrize("scale", [1.0, 8**-0.5])  # T5's (none), MPNet's (head_dim ** -0.5)
@pytest.mark.parametrize("exact", [True, False])
def test_biased_attention_groups_match_per_request_attention(monkeypatch, exact, scale):
    """Unsorted lengths, equal ones apart, some sharing a bucket but not a length: the grouped
    (exact, the CPU's) and padded (bucketed, CUDA's; masks split small here) plans both give
    each request softmax(q k^T * scale + bias) v over its own tokens."""
    monkeypatch.setattr(relative_attention, "_MASK_ELEMENTS", 4 * 40 * 48)
    heads, dim = 4, 8
    table = RelativePositionBias(32, 20, heads)
    torch.manual_seed(0)
    table.weight = torch.nn.Parameter(torch.randn(32, heads))
    table.reset_buffers()
    lens = [5, 17, 3, 17, 30, 1, 5, 29, 33, 40, 18]
    cu = np.concatenate([[0], np.cumsum(lens)])
    qkv = torch.randn(int(cu[-1]), 3 * heads * dim)
    plan = relative_attention.BiasedAttentionPlan.build(cu, table, exact=exact)
    # Exact: a call per length (9). Bucketed: 3 buckets (16, 32, 48 tokens), the two padded
    # ones split to keep their masks under the cap: lengths 1-5 in one call, the five of 17-30
    # padded to 30 in three, 33 and 40 padded to 40 in two.
    assert len(plan.groups) == (9 if exact else 6) and plan.gather is not None
    got = relative_attention.biased_attention(qkv, plan, heads, dim, scale=scale)
    for r, length in enumerate(lens):
        q, k, v = qkv[cu[r] : cu[r + 1]].view(length, 3, heads, dim).unbind(1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale + table(length)[0]
        want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(length, -1)
        torch.testing.assert_close(got[cu[r] : cu[r + 1]], want, rtol=1e-5, atol=1e-5)


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"feed_forward_proj": "gated-silu"}, "feed_forward_proj='gated-silu'"),
        ({"dense_act_fn": "gelu"}, "dense_act_fn='gelu'"),
        ({"is_gated_act": True}, "is_gated_act=True"),  # a gated feed-forward without wi_0/wi_1
        ({"is_decoder": True}, "is_decoder=True"),
    ],
)
def test_unimplemented_t5_fields_are_refused_by_name(t5_paths, tmp_path, changes, named):
    path = _edit_config(t5_paths["relu"], tmp_path / "t5", **changes)
    with pytest.raises(pipepool.ModelLoadError, match=named.replace("(", r"\(")):
        pipepool.Engine(str(path))


def _edit_weights(src: Path, dst: Path, **add: str) -> Path:
    """A copy of ``src`` whose checkpoint also holds tensor ``name`` = a copy of tensor
    ``add[name]`` (plus one, so that the two differ), for each name."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors.update({name: tensors[like] + 1 for name, like in add.items()})
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_t5_tensors_the_family_does_not_compute_fail_loading(t5_paths, tmp_path):
    # A bias table in a second layer: T5 shares layer 0's, so nothing would read it.
    table = "encoder.block.{}.layer.0.SelfAttention.relative_attention_bias.weight"
    extra = {table.format(1): table.format(0)}
    path = _edit_weights(t5_paths["relu"], tmp_path / "extra", **extra)
    unexpected = re.escape(f"unexpected weights: {table.format(1)}")
    with pytest.raises(pipepool.ModelLoadError, match=unexpected):
        pipepool.Engine(str(path))
    # Both names of the embedding: transformers then embeds with encoder.embed_tokens.weight,
    # which may differ from shared.weight; the loader refuses the name held twice.
    both = {"encoder.embed_tokens.weight": "shared.weight"}
    path = _edit_weights(t5_paths["relu"], tmp_path / "both", **both)
    with pytest.raises(pipepool.ModelLoadError, match=re.escape("'shared.weight' appears twice")):
        pipepool.Engine(str(path))


def test_t5_results_do_not_depend_on_batch_company(t5_paths):
    prompts = long_prompts()
    with pipepool.Engine(str(t5_paths["relu"]), max_num_batched_tokens=512) as engine:
        together = engine.embed(prompts)
        alone = np.stack([engine.embed([p])[0] for p in prompts])
    assert cosine(together, alone).min() >= MIN_COSINE


# -- CUDA (skipped where there is no CUDA device) --------------------------------------------


def _errors(outs, expected) -> np.ndarray:
    """1 - cosine per request (per token for "all": the worst token)."""
    return np.array([1.0 - float(cosine(o, e).min()) for o, e in zip(outs, expected, strict=True)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpu_t5_matches_transformers(t5_paths, t5_refs, variant):
    """fp32 on the GPU meets the fp32 bar; bf16 errs against the fp32 reference no more than
    transformers' own bf16 run does (docs/design.md §3: 1.5x its error + 1e-5)."""
    import transformers

    path, ref, prompts = t5_paths[variant], t5_refs[variant], long_prompts()
    ids = [ref.token_ids(p) for p in prompts]
    hf16 = transformers.T5EncoderModel.from_pretrained(str(path), dtype=torch.bfloat16).cuda()
    for dtype in ("float32", "bfloat16"):
        with pipepool.Engine(str(path), device="cuda", dtype=dtype, max_num_batched_tokens=64) as e:
            for pooling in POOLINGS:
                expected = [ref.pooled(i, pooling) for i in ids]
                got = _errors(e.pool(prompts, pooling=pooling, normalize=False), expected)
                if dtype == "float32":
                    assert 1.0 - got.max() >= MIN_COSINE, pooling
                    continue
                with torch.no_grad():
                    hidden = [
                        hf16(input_ids=torch.tensor([i], device="cuda")).last_hidden_state[0]
                        for i in ids
                    ]
                rows = [h.float().cpu().numpy() for h in hidden]
                theirs = [{"mean": h.mean(0), "cls": h[0], "all": h}[pooling] for h in rows]
                bar = 1.5 * _errors(theirs, expected) + 1e-5
                assert (got <= bar).all(), f"{pooling}: engine {got}, bar {bar}"


def test_parity_command_checks_a_t5_encoder(t5_paths, tmp_path, capsys):
    """``pipepool parity``'s transformers reference runs T5's encoder (T5EncoderModel), the
    model pipepool computes, at every pooling, PP=1 and PP=2, chunk-sized budget."""
    import json

    from pipepool.commands.cli import main

    out = tmp_path / "parity.json"
    args = ["parity", "--model", str(next(iter(t5_paths.values()))), "--pp", "1,2"]
    args += ["--max-num-batched-tokens", "16", "--max-model-len", "128", "--json", str(out)]
    assert main(args) == 0, capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["passed"] and report["reference"].startswith("transformers ")
    assert len(report["rows"]) == 8 and all(r["passed"] for r in report["rows"])
