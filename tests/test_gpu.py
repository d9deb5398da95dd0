"""GPU path (bf16, flash varlen attention, torch.compile, NCCL between stages) against the fp32
CPU reference of transformers. Skipped where there is no CUDA device (CI)."""

from __future__ import annotations

import faults
import pytest
import torch
from tiny_models import REPRODUCER_PROMPTS, cosine, long_prompts

import pipepool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
MIN_COSINE_BF16 = 0.999  # docs/design.md §3: bf16 GPU vs the fp32 reference, per request
POOLINGS = ("last", "mean", "cls", "all")


def _worst(engine, ref, prompts, pooling) -> float:
    outs = engine.pool(prompts, pooling=pooling, normalize=False)
    return min(
        float(cosine(o, ref.pooled(ref.token_ids(p), pooling)).min())
        for p, o in zip(prompts, outs, strict=True)
    )


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama", "mistral"])
@pytest.mark.parametrize("budget", [7, 64, 4096])
@pytest.mark.parametrize("compile", [False, True])
def test_bf16_gpu_decoder_matches_fp32_reference(decoder_paths, reference, family, budget, compile):
    path = decoder_paths[family]
    ref = reference(path)
    with pipepool.Engine(
        str(path), device="cuda", dtype="bfloat16", max_num_batched_tokens=budget, compile=compile
    ) as engine:
        assert engine.pipeline.runners[0].model.attn_kernel in ("triton", "flash")
        for pooling in POOLINGS:
            worst = _worst(engine, ref, long_prompts(), pooling)
            assert worst >= MIN_COSINE_BF16, f"{family} {budget} {pooling}: {worst}"


@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_fused_qk_norm_rope_kernel_equals_torch_ops(dtype, qk_norm):
    from pipepool.layers.norm import rms_norm
    from pipepool.layers.qk_rope import fused_qk_norm_rope
    from pipepool.layers.rotary import RotaryEmbedding, apply_rotary

    tokens, hq, hk, d = 301, 16, 8, 128
    rotary = RotaryEmbedding(d, d, 1e6, None, 8192).cuda()
    qkv = (torch.randn(tokens, (hq + 2 * hk) * d, device="cuda") * 3).to(dtype)
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    qw, kw = (
        (torch.rand(d, device="cuda") + 0.5).to(dtype),
        (torch.rand(d, device="cuda") + 0.5).to(dtype),
    )
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], -1)
    q, k = q.reshape(tokens, hq, d), k.reshape(tokens, hk, d)
    if qk_norm:
        q, k = rms_norm(q, qw, 1e-6), rms_norm(k, kw, 1e-6)
    q_ref, k_ref = apply_rotary(positions, q, k, rotary.cos_sin, d)
    q2, k2 = fused_qk_norm_rope(
        qkv, positions, rotary.cos_sin, qw if qk_norm else None, kw if qk_norm else None,
        num_heads=hq, num_kv_heads=hk, head_dim=d, eps=1e-6,
    )  # fmt: skip
    for got, want in ((q2, q_ref), (k2, k_ref)):
        assert (got != want).float().mean().item() < 0.01  # rounding as the eager ops round
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=1e-3)


def test_decoders_use_the_fused_kernel_on_cuda(qwen3_path):
    with pipepool.Engine(str(qwen3_path), device="cuda", compile=False) as engine:
        assert engine.pipeline.runners[0].model.ops.fused_qk_rope


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_gpu_encoder_matches_reference(bert_path, reference, dtype):
    ref = reference(bert_path)
    with pipepool.Engine(str(bert_path), device="cuda", dtype=dtype) as engine:
        for pooling in POOLINGS:
            assert _worst(engine, ref, long_prompts(), pooling) >= MIN_COSINE_BF16


def test_gpu_fp32_portable_kernel_is_exact(qwen3_path, reference):
    ref = reference(qwen3_path)
    with pipepool.Engine(
        str(qwen3_path), device="cuda", dtype="float32", max_num_batched_tokens=16, compile=False
    ) as engine:
        assert engine.pipeline.runners[0].model.attn_kernel == "portable"
        for pooling in POOLINGS:
            assert _worst(engine, ref, long_prompts(), pooling) >= 0.99999


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("budget", [16, 64])
def test_pp2_over_nccl_matches_reference(qwen3_path, reference, budget):
    ref = reference(qwen3_path)
    prompts = REPRODUCER_PROMPTS + long_prompts()
    with pipepool.Engine(
        str(qwen3_path),
        device="cuda",
        dtype="bfloat16",
        pipeline_parallel_size=2,
        max_num_batched_tokens=budget,
        max_num_seqs=5,
    ) as engine:
        for pooling in POOLINGS:
            assert _worst(engine, ref, prompts, pooling) >= MIN_COSINE_BF16
        assert engine.stats.chunked_requests > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_pp2_nccl_bug_injection_is_caught(qwen3_path, monkeypatch):
    faults.install(monkeypatch, "skip_post_step_on_non_last_stage")
    with (
        pipepool.Engine(
            str(qwen3_path),
            device="cuda",
            pipeline_parallel_size=2,
            max_num_batched_tokens=64,
        ) as engine,
        pytest.raises(pipepool.StateDivergence),
    ):
        engine.embed(REPRODUCER_PROMPTS)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_inproc_pp2_moves_hidden_states_between_gpus(qwen3_path, reference):
    """In-process stages on cuda:0 and cuda:1: the link copies hidden states across, and each
    stage runs with its own device current (Triton kernels use the current device)."""
    ref = reference(qwen3_path)
    with pipepool.Engine(
        str(qwen3_path), device="cuda", pipeline_parallel_size=2, pipeline_backend="inproc",
        max_num_batched_tokens=16,
    ) as engine:  # fmt: skip
        devices = [r.spec.device for r in engine.pipeline.runners]
        assert devices == [torch.device("cuda", 0), torch.device("cuda", 1)]
        for pooling in ("last", "mean"):
            assert _worst(engine, ref, long_prompts(), pooling) >= MIN_COSINE_BF16
    count = torch.cuda.device_count()
    with pytest.raises(pipepool.InvalidInputError, match=f"needs {count + 1} GPUs, {count}"):
        pipepool.Engine(
            str(qwen3_path), device="cuda", pipeline_parallel_size=count + 1,
            pipeline_backend="inproc",
        )  # fmt: skip


@pytest.mark.parametrize("path_key", ["qwen3", "bert"])
@pytest.mark.parametrize("budget", [16, 4096])
def test_cuda_graphs_match_eager_and_the_reference(
    decoder_paths, bert_path, reference, path_key, budget
):
    """Replayed pieces around eager attention compute what the eager forward computes: the
    same vectors (up to bf16 GEMM tiling), padded rows never leak into real ones. The decoder's
    LAST and CLS steps at the larger budget replay graphs whose last layer keeps the picked rows
    alone (``StepInputs.keep_rows``); at the smaller, graphs that keep every row."""
    path = bert_path if path_key == "bert" else decoder_paths[path_key]
    ref = reference(path)
    prompts = REPRODUCER_PROMPTS + long_prompts()
    kw = dict(device="cuda", dtype="bfloat16", max_num_batched_tokens=budget, compile=False)
    got = {}
    for graphs in (False, True):
        with pipepool.Engine(str(path), cuda_graphs=graphs, **kw) as engine:
            runner = engine.pipeline.runners[0]
            got[graphs] = {p: engine.pool(prompts, pooling=p, normalize=False) for p in POOLINGS}
            assert bool(getattr(runner.forward, "captured", None)) == graphs
            if graphs and path_key != "bert":
                keeping = [k for k in runner.forward.captured if isinstance(k, tuple)]
                assert bool(keeping) == (budget == 4096), runner.forward.captured.keys()
    for pooling in POOLINGS:
        for o_graph, o_eager, p in zip(
            got[True][pooling], got[False][pooling], prompts, strict=True
        ):
            assert float(cosine(o_graph, o_eager).min()) >= 0.9999, pooling
            assert float(cosine(o_graph, ref.pooled(ref.token_ids(p), pooling)).min()) >= (
                MIN_COSINE_BF16
            )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_pp2_nccl_with_cuda_graphs_matches_reference(qwen3_path, reference):
    ref = reference(qwen3_path)
    prompts = REPRODUCER_PROMPTS + long_prompts()
    with pipepool.Engine(
        str(qwen3_path), device="cuda", dtype="bfloat16", pipeline_parallel_size=2,
        max_num_batched_tokens=64, cuda_graphs=True, compile=True,
    ) as engine:  # fmt: skip
        for pooling in POOLINGS:
            assert _worst(engine, ref, prompts, pooling) >= MIN_COSINE_BF16


@pytest.mark.parametrize("model", ["cross_encoder_path", "qwen3_reranker_path"])
def test_gpu_graphed_rerank_scores_equal_cpu_fp32(request, model):
    """Issue 13: pair token types reach an encoder replayed as CUDA graphs (they are copied
    into the graphs' buffer), and the heads run on the GPU's last stage; fp32 on both sides."""
    from test_rerank import DOCUMENTS, QUERY

    path = str(request.getfixturevalue(model))
    options = {"max_num_batched_tokens": 256, "max_model_len": 480}
    with pipepool.Engine(path, device="cpu", **options) as cpu:
        expected = cpu.score(QUERY, DOCUMENTS, use_activation=False)
    with pipepool.Engine(path, device="cuda", dtype="float32", cuda_graphs=True, **options) as gpu:
        # compile left to the engine: graphs are captured once the compiled bodies are in
        assert gpu.pipeline.wait_until_compiled(timeout=300)
        runner = gpu.pipeline.runners[0]
        assert runner.forward is not runner.model  # graphed
        got = gpu.score(QUERY, DOCUMENTS, use_activation=False)
        again = gpu.score(QUERY, DOCUMENTS, use_activation=False)  # replays the captured graphs
    assert abs(got - expected).max() <= 1e-3
    assert (got == again).all()


@pytest.fixture(scope="module")
def bert_d32_path(model_dir):
    """The tiny BERT with two heads of 32: a head size the Triton attention kernel takes."""
    import tiny_models

    return tiny_models.make_bert(model_dir / "bert-d32", num_heads=2)


def test_whole_step_graphs_take_steps_of_many_short_requests(bert_d32_path, reference):
    """An encoder replayed as one graph a step: steps whose attention work list outgrows the
    usual grid (dozens of 1-3 token prompts in a 64-token step) replay the larger grid's
    graph; every vector agrees with the eager engine's and the reference's."""
    bert_path = bert_d32_path
    ref = reference(bert_path)
    # Two calls: a few prompts of ~20 tokens (steps of at most 4 requests: the usual grid),
    # then dozens of 1-3 token prompts (64-token steps of ~25 requests: the larger grid).
    calls = (
        ["Mixed-length pooling request " * 5, "A short sentence for embedding. " * 3, "tail"],
        ["a", "b c", *[str(i) for i in range(60)]],
    )
    kw = dict(device="cuda", dtype="bfloat16", max_num_batched_tokens=64, compile=False)
    got = {}
    for graphs in (False, True):
        with pipepool.Engine(str(bert_path), cuda_graphs=graphs, **kw) as engine:
            got[graphs] = [engine.pool(c, pooling="mean", normalize=False) for c in calls]
            forward = engine.pipeline.runners[0].forward
            if graphs:
                assert forward.whole
                grids = {programs for _, programs in forward.captured}
                assert 64 in grids and min(grids) < 64, grids  # both grids were replayed
    for i, prompts in enumerate(calls):
        for o_graph, o_eager, p in zip(got[True][i], got[False][i], prompts, strict=True):
            assert float(cosine(o_graph, o_eager).min()) >= 0.9999, p
            want = ref.pooled(ref.token_ids(p), "mean")
            assert float(cosine(o_graph, want).min()) >= MIN_COSINE_BF16, p
