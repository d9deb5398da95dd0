"""Key lengths (ColBERT's query expansion, PyLate's ``attend_to_expansion_tokens=False``): a
prompt's attention keys are its first ``key_len`` tokens, and every token, those after
included, still attends over them and has an output. Exactly what Hugging Face computes for
``attention_mask = [1] * key_len + [0] * (length - key_len)``, at every position.

From the batch to the plan (scheduler), the plan to the step's attention metadata (the CPU
grouped kernel, the portable one, CPU tiles), and through the engine on every pipeline kind
against transformers, with steps that mix requests with and without key lengths.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_scheduler import answer
from tiny_encoders import make_mpnet
from tiny_models import MIN_COSINE, cosine, make_decoder

import pipepool
from pipepool.core.plan import NewRequests
from pipepool.core.request import PoolingParams, RequestBatch
from pipepool.core.scheduler import Scheduler
from pipepool.errors import EngineDeadError, InvalidInputError
from pipepool.intake.inputs import TokenSlice
from pipepool.layers import attention
from pipepool.layers.cpu_tiles import plan_tiles
from pipepool.stage.batch import DeviceUploader, build_host_batch, to_step_inputs

MASK = 103  # the MiniLM vocabulary's [MASK], ColBERT's query expansion token
PARAMS = PoolingParams(pooling="all")


# -- from batches to plans ----------------------------------------------------------------------


def _encoder_scheduler(budget: int) -> Scheduler:
    return Scheduler(max_num_batched_tokens=budget, max_num_seqs=8, chunked=False, blocks=None)


def test_key_lens_travel_from_batches_into_the_plans_of_new_requests():
    sched = _encoder_scheduler(budget=16)
    # Steps: {6, 0} (the small tail call goes in whole first: plain rows only), {1, 2} (a
    # plain row beside a keyed one), {3}, {4} (20 > budget: alone), {5}.
    plain = RequestBatch(0, np.arange(15), np.array([7, 8]), PARAMS)
    keyed_lens = np.array([6, 8, 20, 3])
    keyed = RequestBatch(2, np.arange(37), keyed_lens, PARAMS, key_lens=np.array([3, 0, 11, 3]))
    tail = RequestBatch(6, np.arange(2), np.array([2]), PARAMS)
    for batch in (plain, keyed, tail):
        sched.add(batch)
    seen: dict[int, int] = {}
    plain_only_steps = 0
    prompt_lens = {0: 7, 1: 8, 2: 6, 3: 8, 4: 20, 5: 3, 6: 2}
    while (plan := sched.schedule()) is not None:
        new = plan.new
        if set(new.request_ids.tolist()) <= {0, 1, 6}:
            plain_only_steps += 1
            assert not len(new.key_lens)  # nothing to send where every token is a key
        else:
            assert len(new.key_lens) == len(new)
            seen.update(zip(new.request_ids.tolist(), new.key_lens.tolist(), strict=True))
        assert plan.without_tokens().new is new  # every stage attends: every stage gets them
        sched.update(plan, answer(plan, prompt_lens), last_stage=0)
    assert plain_only_steps == 1
    assert seen == {1: 0, 2: 3, 3: 0, 4: 11, 5: 3}  # a plain row sharing a step: 0


def test_restarted_rows_keep_their_key_lens_and_causal_schedulers_refuse_them():
    batch = RequestBatch(10, np.arange(12), np.array([3, 4, 5]), PARAMS, key_lens=[1, 0, 4])
    assert batch.has_key_lens
    again = batch.rows(40, 1, 3)
    assert again.first_id == 40 and again.key_lens.tolist() == [0, 4]
    assert not RequestBatch(0, np.arange(3), np.array([3]), PARAMS, key_lens=[3]).has_key_lens
    with pytest.raises(AssertionError):
        RequestBatch(0, np.arange(3), np.array([3]), PARAMS, key_lens=[4])
    from pipepool.core.kv_blocks import BlockAllocator

    causal = Scheduler(
        max_num_batched_tokens=8, max_num_seqs=4, chunked=True, blocks=BlockAllocator(64, 4)
    )
    with pytest.raises(ValueError, match="causal"):
        causal.add(batch)


def test_new_requests_check_their_key_lens():
    none = NewRequests.none()
    assert not len(none.key_lens) and not none.has_key_lens
    base = dict(
        request_ids=np.array([0, 1]), prompt_lens=np.array([4, 6]),
        poolings=np.zeros(2, np.int8), normalize=np.zeros(2, bool),
        dimensions=np.zeros(2, np.int64), block_offsets=np.zeros(3, np.int64),
        block_ids=np.empty(0, np.int32),
    )  # fmt: skip
    assert not NewRequests(**base).has_key_lens  # every constructor without them still works
    assert NewRequests(**base, key_lens=np.array([0, 2])).has_key_lens
    assert not NewRequests(**base, key_lens=np.array([4, 6])).has_key_lens
    with pytest.raises(AssertionError):
        NewRequests(**base, key_lens=np.array([5, 1]))


# -- from the plan to attention ------------------------------------------------------------------


def _reference(q, k, v, key_len: int, scale: float) -> torch.Tensor:
    """Every query of one request over its first key_len keys, in float64."""
    scores = torch.einsum("qhd,khd->hqk", q.double(), k[:key_len].double()) * scale
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[:key_len].double())


def _step(lens, key_lens, heads=2, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lens, key_lens = np.asarray(lens), np.asarray(key_lens)
    batch = build_host_batch(np.zeros(len(lens), np.int64), lens, lens, None, [], 16, key_lens)
    inputs, _ = to_step_inputs(batch, DeviceUploader(torch.device("cpu")), causal=False, extra=[])
    q, k, v = (torch.randn(int(lens.sum()), heads, dim, generator=gen) for _ in "qkv")
    cu = batch.cu_q
    ref = torch.cat(
        [
            _reference(q[a:b], k[a:b], v[a:b], int(n), dim**-0.5)
            for a, b, n in zip(cu[:-1], cu[1:], key_lens, strict=True)
        ]
    )
    return inputs.attn, (q, k, v), ref


def test_step_metadata_gathers_each_requests_prefix_keys():
    meta, _, _ = _step([4, 4, 6], [2, 4, 3])
    assert meta.cu_k_host.tolist() == [0, 2, 6, 9] and meta.total_k == 9 and meta.max_k == 4
    assert meta.key_rows is not None
    assert meta.key_rows.tolist() == [0, 1, 4, 5, 6, 7, 8, 9, 10]
    assert meta.cu_seqlens_k.tolist() == [0, 2, 6, 9] and meta.max_q == 6
    assert meta.key_lens.tolist() == [2, 4, 3]
    plain = build_host_batch(
        np.zeros(2, np.int64), np.array([3, 5]), np.array([3, 5]), None, [], 16
    )
    assert plain.key_rows is None and plain.cu_k is plain.cu_q  # unchanged without key lengths


@pytest.mark.parametrize(
    ("lens", "key_lens"),
    [
        ([16] * 8, [5, 5, 5, 5, 9, 9, 9, 16]),  # runs of several equal-length requests
        ([7, 7, 30, 30, 30, 1], [1, 7, 17, 17, 30, 1]),  # keys not a multiple of 16: padded
    ],
)
def test_cpu_grouped_and_portable_kernels_attend_over_prefix_keys(lens, key_lens):
    meta, (q, k, v), ref = _step(lens, key_lens)
    scale = q.shape[-1] ** -0.5
    out = attention.attend(q, k, v, meta, None, scale=scale)  # CPU: grouped runs
    assert meta.group_plan is not None
    assert any(r.size > 1 and r.len_q != r.len_k for r in meta.group_plan.runs)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    kg, vg = attention.with_cached_keys(k, v, meta, None)
    portable = attention._portable(q, kg, vg, meta, scale, None)  # other devices: per request
    torch.testing.assert_close(portable.double(), ref, rtol=1e-5, atol=1e-5)


def test_cpu_tiles_keep_each_requests_key_lens():
    lens, key_lens = np.array([5, 9, 3, 9, 12, 2]), np.array([5, 4, 1, 9, 6, 2])
    meta, (q, k, v), ref = _step(lens, key_lens, seed=1)
    tiles = plan_tiles(meta.cu_q_host, tile_tokens=12, key_lens=meta.key_lens)
    assert len(tiles) > 1
    out = torch.empty_like(q)
    for tile in tiles:
        rows = tile.rows
        got = attention.attend(q[rows], k[rows], v[rows], tile.meta, None, scale=8**-0.5)
        out[rows] = got
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


# -- through the engine, against transformers --------------------------------------------------


def _queries(rng: np.random.Generator, count: int, *, low: int = 3, high: int = 24):
    """ColBERT-style queries: random tokens padded with [MASK] after their key length; every
    third keys all its tokens (0), as a request without key lengths does."""
    prompts, keys = [], []
    for i in range(count):
        n = int(rng.integers(low, high))
        k = int(rng.integers(1, n + 1))
        ids = rng.integers(1000, 9000, n)
        ids[k:] = MASK
        prompts.append(ids.astype(np.int64))
        keys.append(0 if i % 3 == 2 else k)
    return prompts, np.array(keys, np.int64)


def _token_embeddings(engine, prompts, key_lens) -> list[np.ndarray]:
    lengths = np.array([len(p) for p in prompts], np.int64)
    params = engine.info.pooling_params("all", None, False)
    return list(
        engine.submit_tokens(np.concatenate(prompts), lengths, params, None, key_lens).result()
    )


@torch.no_grad()
def _hf_tokens(model, ids: np.ndarray, key_len: int, device: str = "cpu") -> np.ndarray:
    key_len = key_len or len(ids)
    mask = torch.tensor([[1] * key_len + [0] * (len(ids) - key_len)], device=device)
    out = model(input_ids=torch.from_numpy(ids)[None].to(device), attention_mask=mask)
    return out.last_hidden_state[0].float().cpu().numpy()


def _assert_matches_transformers(engine, path: Path, prompts, key_lens) -> None:
    import transformers

    model = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    outs = _token_embeddings(engine, prompts, key_lens)
    masked_differ = 0
    for ids, key_len, out in zip(prompts, key_lens.tolist(), outs, strict=True):
        want = _hf_tokens(model, ids, key_len)
        assert out.shape == want.shape
        worst = float(cosine(out, want).min())  # per token, the unkeyed ones included
        assert worst >= MIN_COSINE, f"{len(ids)} tokens, key length {key_len}: cosine {worst}"
        if 0 < key_len < len(ids):  # the key lengths change the result: they are honoured
            masked_differ += float(cosine(out, _hf_tokens(model, ids, 0)).min()) < 0.999
    assert masked_differ >= 3


@pytest.fixture(scope="module")
def bert_engine(bert_path, engine_kind):
    # 64 tokens a step: several queries share each step, plus one longer than the budget.
    with pipepool.Engine(str(bert_path), max_num_batched_tokens=64, **engine_kind) as engine:
        yield engine


def test_bert_token_embeddings_with_key_lens_match_transformers(bert_engine, bert_path):
    prompts, key_lens = _queries(np.random.default_rng(0), 14)
    long = np.full(80, MASK, np.int64)
    long[:50] = np.arange(2000, 2050)
    prompts.append(long)  # alone in a step of its own (over the budget), keys its first 50
    key_lens = np.append(key_lens, 50)
    _assert_matches_transformers(bert_engine, bert_path, prompts, key_lens)


def test_calls_without_key_lens_are_unchanged(bert_engine, bert_path):
    prompts, _ = _queries(np.random.default_rng(1), 6)
    none = _token_embeddings(bert_engine, prompts, None)
    zeros = _token_embeddings(bert_engine, prompts, np.zeros(len(prompts), np.int64))
    full = _token_embeddings(bert_engine, prompts, np.array([len(p) for p in prompts]))
    for a, b, c in zip(none, zeros, full, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_xlm_roberta_token_embeddings_with_key_lens_match_transformers(xlmr_path):
    prompts, key_lens = _queries(np.random.default_rng(2), 10)
    with pipepool.Engine(str(xlmr_path), max_num_batched_tokens=48) as engine:
        _assert_matches_transformers(engine, xlmr_path, prompts, key_lens)


def test_grouped_kernel_attends_runs_of_equal_length_queries(bert_path, monkeypatch):
    """A step of equal-length queries (ColBERT pads every query to query_length) attends in
    runs of several requests, each run querying more rows than it keys."""
    runs = []
    real = attention.plan_runs

    def recording(cu_q, cu_k, causal):
        plan = real(cu_q, cu_k, causal)
        runs.extend(plan.runs)
        return plan

    monkeypatch.setattr(attention, "plan_runs", recording)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1000, 9000, 16).astype(np.int64) for _ in range(8)]
    key_lens = np.array([5, 5, 5, 5, 9, 9, 9, 0])
    for ids, k in zip(prompts, key_lens, strict=True):
        ids[k or 16 :] = MASK
    with pipepool.Engine(str(bert_path), max_num_batched_tokens=256) as engine:
        _assert_matches_transformers(engine, bert_path, prompts, key_lens)
    assert any(r.size >= 3 and r.len_q == 16 and r.len_k in (5, 9) for r in runs)


def test_bidirectional_decoder_token_embeddings_with_key_lens_match_transformers(model_dir):
    path = make_decoder(model_dir / "qwen3-bidirectional-keys", "qwen3", is_causal=False)
    prompts, key_lens = _queries(np.random.default_rng(4), 8)
    for ids in prompts:
        ids[ids >= 600] %= 600  # the tiny decoder's vocabulary; [MASK] becomes a plain token
    with pipepool.Engine(str(path), max_num_batched_tokens=48) as engine:
        _assert_matches_transformers(engine, path, prompts, key_lens)


# -- what cannot honour them refuses them --------------------------------------------------------


def test_bad_key_lens_are_refused_naming_the_input(bert_engine):
    prompts = [np.arange(1000, 1005), np.arange(1000, 1003)]
    for bad, match in (([1, 4], "input 1"), ([-1, 2], "input 0"), ([1], "one per prompt")):
        with pytest.raises(InvalidInputError, match=match):
            _token_embeddings(bert_engine, prompts, np.array(bad))


def test_causal_and_position_biased_models_refuse_key_lens(qwen3_path, model_dir):
    prompts = [np.arange(5, 10), np.arange(5, 8)]
    with (
        pipepool.Engine(str(qwen3_path)) as engine,
        pytest.raises(InvalidInputError, match="causal"),
    ):
        _token_embeddings(engine, prompts, np.array([2, 3]))
    mpnet = make_mpnet(model_dir / "mpnet-keys")
    with pipepool.Engine(str(mpnet), stage_restarts=0) as engine:
        with pytest.raises(InvalidInputError, match="MPNet"):
            _token_embeddings(engine, prompts, np.array([2, 3]))
        # Past the engine's check (a caller that skipped it), the stage refuses them itself.
        params = engine.info.pooling_params("all", None, False)
        submission = engine._embedder._new_submission(params, 2)
        part = TokenSlice(0, np.concatenate(prompts), np.array([5, 3]), None, np.array([2, 3]))
        engine.pipeline.enqueue(submission, part)
        with pytest.raises(EngineDeadError, match="key lengths"):
            submission.result(timeout=120)


# -- GPU: the fast kernels and CUDA graphs ------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kernel", ["triton", "flash", "varlen"])
@pytest.mark.parametrize("dim", [32, 64])
def test_gpu_kernels_attend_over_prefix_keys(kernel, dim):
    from pipepool.layers import triton_attention

    device = torch.device("cuda")
    lens = np.array([16, 16, 16, 70, 70, 5, 130])
    key_lens = np.array([5, 5, 16, 33, 70, 1, 64])
    batch = build_host_batch(np.zeros(len(lens), np.int64), lens, lens, None, [], 16, key_lens)
    block_rows = triton_attention.block_rows(dim) if kernel == "triton" else None
    inputs, _ = to_step_inputs(
        batch, DeviceUploader(device), causal=False, extra=[], attn_block_rows=block_rows
    )
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(int(lens.sum()), 4, dim, generator=gen) for _ in "qkv")
    cu = batch.cu_q
    want = torch.cat(
        [
            _reference(q[a:b], k[a:b], v[a:b], int(n), dim**-0.5)
            for a, b, n in zip(cu[:-1], cu[1:], key_lens, strict=True)
        ]
    )
    q, k, v = (x.to(device, torch.bfloat16) for x in (q, k, v))
    got = attention.attend(q, k, v, inputs.attn, None, scale=dim**-0.5, kernel=kernel)
    torch.testing.assert_close(got.double().cpu(), want, rtol=2e-2, atol=2e-2)
    shape = attention.AttentionShape(dim, 1, causal=False, windowed=False)
    assert attention.choose_kernel(device, torch.bfloat16, shape) == "triton"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kernel", ["triton", "flash"])
def test_gpu_bf16_engine_with_cuda_graphs_honours_key_lens(model_dir, kernel, monkeypatch):
    """The triton kernel's whole-step graphs run steps with key lengths eagerly; the flash
    kernel's piecewise graphs replay them with eager attention over the gathered keys."""
    from tiny_models import make_bert

    from pipepool.loading import deployment
    from pipepool.stage.cuda_graphs import GraphedForward

    path = make_bert(model_dir / "bert-head32", num_heads=2)  # head dim 32: the triton kernel
    monkeypatch.setattr(deployment, "choose_kernel", lambda *args: kernel)
    prompts, key_lens = _queries(np.random.default_rng(6), 24, high=40)
    options = dict(device="cuda", dtype="bfloat16", cuda_graphs=True, compile=False)
    with pipepool.Engine(str(path), max_num_batched_tokens=128, **options) as engine:
        runner = engine.pipeline.runners[0]
        assert runner.model.attn_kernel == kernel and isinstance(runner.forward, GraphedForward)
        import transformers

        model = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
        for keys in (np.zeros_like(key_lens), key_lens):  # plain steps capture the graphs
            outs = _token_embeddings(engine, prompts, keys)
            for ids, key_len, out in zip(prompts, keys.tolist(), outs, strict=True):
                worst = float(cosine(out, _hf_tokens(model, ids, key_len)).min())
                assert worst >= 0.999, f"{kernel}: key length {key_len}: cosine {worst}"
        assert runner.forward.captured


def test_modernbert_token_embeddings_with_key_lens_match_transformers(model_dir):
    """Local layers see the keys of their window that are keys (a query past them by more
    than the window sees none: zeros, as transformers' boolean mask gives), also in blocks
    (prompts over four windows long); global layers see every key."""
    from tiny_modernbert import make_modernbert

    path = make_modernbert(model_dir / "modernbert-keys")  # local layers: 8 keys either side
    prompts, key_lens = _queries(np.random.default_rng(7), 10, high=40)
    for n, k in ((100, 30), (90, 0), (70, 3)):  # blocked windows; keys far behind the end
        ids = np.full(n, MASK, np.int64)
        ids[: k or n] = np.arange(3000, 3000 + (k or n))
        prompts.append(ids)
        key_lens = np.append(key_lens, k)
    with pipepool.Engine(str(path), max_num_batched_tokens=128) as engine:
        _assert_matches_transformers(engine, path, prompts, key_lens)


@pytest.mark.gpu
@needs_gpu
def test_gpu_modernbert_honours_key_lens(model_dir):
    """Global layers on the deployment's kernel over the gathered keys; local layers on the
    portable windowed path (the flash kernel's window would align to the last key). fp32 (the
    portable kernel) to the reference's precision; bf16 (a fast kernel) within docs/design.md §3's
    bound of transformers' own bf16 error, which is large on the rows whose window holds no
    key (their local attention is zero: the residual alone carries them)."""
    import transformers
    from tiny_modernbert import make_modernbert

    path = make_modernbert(model_dir / "modernbert-keys-gpu", num_attention_heads=2)
    prompts, key_lens = _queries(np.random.default_rng(8), 16, high=40)
    model = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    half = transformers.AutoModel.from_pretrained(str(path), dtype=torch.bfloat16).eval().cuda()
    for dtype in ("float32", "bfloat16"):
        options = dict(device="cuda", dtype=dtype, max_num_batched_tokens=256)
        with pipepool.Engine(str(path), **options) as engine:
            kernel = engine.pipeline.runners[0].model.attn_kernel
            assert (kernel == "portable") == (dtype == "float32")
            outs = _token_embeddings(engine, prompts, key_lens)
        for ids, key_len, out in zip(prompts, key_lens.tolist(), outs, strict=True):
            want = _hf_tokens(model, ids, key_len)
            error = 1 - cosine(out, want)  # per token
            if dtype == "float32":
                assert error.max() <= 1 - MIN_COSINE, f"fp32, key length {key_len}"
                continue
            own = 1 - cosine(_hf_tokens(half, ids, key_len, device="cuda"), want)
            assert (error <= 1.5 * own + 1e-5).all(), f"bf16, key length {key_len}"
