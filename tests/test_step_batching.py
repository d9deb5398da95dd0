"""Issue 10: host work per step, not per request. Requests travel in batches, a call is one
future, pooling and heads run over the whole step at once, tokenisation is sliced, and every
engine option is declared once. Results are checked against transformers per request, with
budgets small enough that prompts are chunked and steps mix calls with different heads."""

from __future__ import annotations

import subprocess
import sys
import threading
from dataclasses import fields

import numpy as np
import pytest
from tiny_models import MIN_COSINE, cosine, long_prompts

import pipepool
import pipepool.driver.pacing
from pipepool.config import EngineConfig
from pipepool.intake.inputs import FIRST_SLICE, FIRST_SLICE_IDS, SLICE, _slice_bounds


@pytest.fixture(scope="module")
def qwen3_engine(qwen3_path):
    with pipepool.Engine(str(qwen3_path), max_num_batched_tokens=24, normalize=False) as engine:
        yield engine


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_calls_with_different_heads_sharing_steps_each_get_their_own(
    qwen3_engine, qwen3_path, reference
):
    """Five calls in flight at once (so steps hold several of them): each gets its pooling,
    Matryoshka width and normalisation, computed on the device for the whole step."""
    ref = reference(qwen3_path)
    prompts = long_prompts()
    calls = [
        dict(pooling="last", dimensions=None, normalize=False),
        dict(pooling="mean", dimensions=16, normalize=True),
        dict(pooling="cls", dimensions=None, normalize=True),
        dict(pooling="last", dimensions=8, normalize=False),
        dict(pooling="all", dimensions=12, normalize=True),
    ]
    submissions = [qwen3_engine.submit(prompts, **c) for c in calls]
    for c, submission in zip(calls, submissions, strict=True):
        got = submission.result(timeout=120)
        for p, out in zip(prompts, got, strict=True):
            want = ref.pooled(ref.token_ids(p), c["pooling"])
            if c["dimensions"]:
                want = want[..., : c["dimensions"]]
                assert out.shape[-1] == c["dimensions"]
            if c["normalize"]:
                want = _unit(want)
                assert np.allclose(np.linalg.norm(out, axis=-1), 1.0, atol=1e-5)
            assert cosine(out, want).min() >= MIN_COSINE, c
            if not c["normalize"]:  # heads must not touch the length of a raw vector
                assert np.allclose(out, want, rtol=1e-4, atol=1e-4)
    assert qwen3_engine.stats.chunked_requests > 0


def test_submission_reports_progress_and_token_counts(qwen3_engine):
    prompts = long_prompts() * 3
    seen = []
    submission = qwen3_engine.submit(prompts, pooling="mean")
    lock = threading.Lock()

    def record(n: int) -> None:
        with lock:
            seen.append(n)

    submission.add_progress_callback(record)
    vectors = submission.result(timeout=120)
    assert vectors.shape == (len(prompts), qwen3_engine.info.dimensions)
    assert submission.num_done == len(prompts)
    assert sum(seen) <= len(prompts)  # steps finished before the callback are not replayed
    tokens = [len(t) for t in qwen3_engine.tokenize(prompts)]
    assert submission.num_tokens.tolist() == tokens


def test_cancelled_call_frees_its_blocks_and_the_engine_goes_on(qwen3_engine):
    blocks = qwen3_engine.pipeline.kv_blocks_free
    submission = qwen3_engine.submit(long_prompts() * 10, pooling="last")
    assert submission.cancel()
    assert submission.cancelled()
    after = qwen3_engine.embed(long_prompts()[:2])  # the engine is idle again, and serves
    assert after.shape[0] == 2
    assert qwen3_engine.pipeline.kv_blocks_free == blocks
    # what no plan took left the backlog at abort
    assert qwen3_engine.pipeline._pacer.backlog_tokens == 0
    assert qwen3_engine.stats.requests_aborted > 0


def test_text_is_tokenised_in_slices_with_the_same_results(bert_path, reference):
    """More texts than one tokenisation slice: enqueued slice by slice, results in order."""
    ref = reference(bert_path)
    n = 3 * FIRST_SLICE + 100
    slices = list(_slice_bounds(n, None))
    assert len(slices) == 3
    texts = [f"sentence number {i} about {'cats' if i % 2 else 'dogs'}" for i in range(n)]
    with pipepool.Engine(str(bert_path), max_num_batched_tokens=512, normalize=False) as engine:
        got = engine.pool(texts, pooling="cls")
        assert engine.stats.requests_finished == len(texts)
    for i in sorted({i for lo, hi in slices for i in (lo, hi - 1)}):  # each slice's ends
        want = ref.pooled(ref.token_ids(texts[i]), "cls")
        assert cosine(got[i], want).min() >= MIN_COSINE, i


def test_a_bad_input_in_a_later_slice_leaves_nothing_queued(bert_path):
    texts = ["fine"] * 1500
    texts[1400] = "word " * 5000  # too long, found when its slice is tokenised
    with pipepool.Engine(str(bert_path), long_inputs="error") as engine:
        with pytest.raises(pipepool.PromptTooLongError, match="input 1400"):
            engine.embed(texts)
        assert engine.embed(["still serving"]).shape[0] == 1
        # Nothing of the call is left to plan; a step of it may still be computing, since a
        # light call like the one above can be served between two of its layers (issue 57).
        assert engine.pipeline._scheduler.num_waiting == 0
        # A large call runs only after that step is done (one step in flight on this
        # pipeline): once it is answered, nothing of the cancelled call is admitted either.
        assert engine.embed(["still serving"] * 1000).shape[0] == 1000
        assert engine.pipeline._scheduler.num_admitted == 0


def test_empty_prompt_and_option_errors_name_the_problem(bert_path):
    with pytest.raises(pipepool.InvalidInputError, match="unknown engine option 'max_num_seq'"):
        pipepool.Engine(str(bert_path), max_num_seq=4)


def test_every_offered_option_has_a_flag_and_an_environment_variable(monkeypatch):
    """One source of truth: the CLI derives its engine flags from EngineConfig."""
    from pipepool.commands.cli import build_parser
    from pipepool.commands.common import engine_config

    parser = build_parser()
    offered = [f for f in fields(EngineConfig) if f.metadata.get("cli")]
    assert len(offered) >= 12
    args = parser.parse_args(["embed", "x"])
    assert engine_config(args) == EngineConfig()  # flags left out keep the config's defaults
    args = parser.parse_args(
        ["embed", "x", "--pp", "2", "--max-num-seqs", "7", "--no-cuda-graphs",
         "--pp-partition", "1,1", "--no-verify-state"]
    )  # fmt: skip
    config = engine_config(args)
    assert (config.pipeline_parallel_size, config.max_num_seqs) == (2, 7)
    assert config.cuda_graphs is False and config.verify_state is False
    assert config.pp_partition == (1, 1)
    monkeypatch.setenv("PIPEPOOL_MAX_NUM_BATCHED_TOKENS", "99")
    monkeypatch.setenv("PIPEPOOL_COMPILE", "0")
    config = engine_config(build_parser().parse_args(["embed", "x"]))
    assert config.max_num_batched_tokens == 99 and config.compile is False


def test_auto_options_are_resolved_once_in_the_deployment(minilm_path):
    from pipepool.loading.deployment import plan_deployment

    d = plan_deployment(EngineConfig(model=str(minilm_path), device="cpu"))
    assert (d.compile, d.graph_max_tokens, d.overlap_steps) == (False, 0, False)
    assert d.max_num_batched_tokens == 2048  # the CPU's default step (see EngineConfig)
    assert d.max_num_seqs == d.max_num_batched_tokens  # no cap below the token budget
    # Asked for, CUDA graphs get a largest step from the model's FLOPs per token: a small
    # encoder's whole budget.
    d = plan_deployment(EngineConfig(model=str(minilm_path), device="cpu", cuda_graphs=True))
    assert d.graph_max_tokens == d.max_num_batched_tokens


def test_a_batch_invariant_forward_replays_larger_steps_as_graphs():
    from pipepool.loading.deployment import _graph_max_tokens

    # FLOPs per token of the non-embedding weights: Qwen3-0.6B's and an 8B model's.
    small, big = 2 * 0.44e9, 2 * 7e9
    assert _graph_max_tokens(16384, small, invariant=False) == 2048
    assert _graph_max_tokens(16384, big, invariant=False) == 512
    # The invariant forward launches every op from Python: the 0.6B's whole budget replays,
    # and an 8B model's steps up to 2,048 tokens (larger ones keep the GPU busy themselves).
    assert _graph_max_tokens(16384, small, invariant=True) == 16384
    assert _graph_max_tokens(16384, big, invariant=True) == 2048


def test_the_invariant_graphs_have_their_memory_set_aside(minilm_path):
    """The invariant forward's graphs replay large steps: their private pool at the largest
    bucket comes out of the KV cache's share, not out of the memory the cache took (a capture
    that runs out of memory runs eagerly)."""
    from pipepool.loading.deployment import memory_needs

    def working_set(**options) -> int:
        return memory_needs(EngineConfig(model=str(minilm_path), **options), "cuda").activations

    default = working_set()
    assert working_set(batch_invariant=True) > 2 * default
    assert working_set(batch_invariant=True, cuda_graphs=False) == default
    on_cpu = memory_needs(EngineConfig(model=str(minilm_path), batch_invariant=True), "cpu")
    assert (
        on_cpu.activations == memory_needs(EngineConfig(model=str(minilm_path)), "cpu").activations
    )


def test_the_driver_side_imports_without_torch():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # importing torch now raises ImportError\n"
        "from pipepool.core.scheduler import Scheduler\n"
        "from pipepool.core.request import RequestBatch, PoolingParams\n"
        "from pipepool.core import stats, kv_blocks, plan\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_graph_buckets_pad_large_steps_by_at_most_a_quarter():
    from pipepool.stage.cuda_graphs import graph_buckets

    buckets = graph_buckets(16384)
    assert buckets[:5] == [16, 32, 64, 128, 256] and buckets[-1] == 16384
    for n in range(257, 16385, 37):
        bucket = next(b for b in buckets if b >= n)
        assert bucket - n <= 0.25 * n, n


def test_default_step_budget_grows_for_small_models_on_cuda():
    """A step of ~2 TFLOP on CUDA, between TEI's 16384 tokens and 65536: MiniLM-sized models
    (~21 MFLOP a token) get 65536, bge-small-sized (~42) 32768, larger ones 16384; the CPU
    keeps 2048 and a budget the user gives wins everywhere."""
    from pipepool.loading.deployment import step_tokens

    default, given = EngineConfig(), EngineConfig(max_num_batched_tokens=4096)
    budgets = [step_tokens(default, True, mflops * 1e6) for mflops in (21.2, 42.5, 170, 1200)]
    assert budgets == [65536, 32768, 16384, 16384]
    assert step_tokens(default, False, 21.2e6) == 2048
    assert step_tokens(given, True, 21.2e6) == step_tokens(given, False, 21.2e6) == 4096


def test_an_idle_pipeline_starts_with_half_a_step_then_whole_ones_built_while_each_runs(
    bert_path, reference
):
    """Running ahead (depth 2, as on CUDA), a call of two slices: the step that starts the idle
    pipeline holds at most half the budget, so the device starts soon; the loop builds the next
    step while it runs (submitting it before collecting the first); and where a slice's rest is
    less than a step, the loop waits for the caller's next slice rather than send a short step,
    so every step but the first and the last is whole. The waits are bounded; here the bound is
    widened so the order is certain on a slow machine. Every vector still agrees with
    transformers."""
    rng = np.random.default_rng(0)
    n = FIRST_SLICE_IDS + 300
    inputs = [rng.integers(1000, 2000, size=int(k)) for k in rng.integers(3, 8, size=n)]
    budget, longest = 256, 7
    events = []
    with pipepool.Engine(
        str(bert_path), device="cpu", overlap_steps=True, max_num_batched_tokens=budget
    ) as engine:
        assert engine.pipeline._executor.depth == 2
        executor = engine.pipeline._executor
        submit, collect = executor.submit, executor.collect
        executor.submit = lambda plan: (events.append(("submit", plan.num_tokens)), submit(plan))[1]
        executor.collect = lambda: (events.append(("collect", None)), collect())[1]
        wait = engine.pipeline._next_slice_arrived
        engine.pipeline._next_slice_arrived = lambda: wait(timeout_s=10.0)
        # The second slice comes late: only once the loop is short of a step (or after 5 s).
        short, enqueue, loop_short = (
            engine.pipeline._pacer.short_of_a_step,
            engine.pipeline.enqueue,
            threading.Event(),
        )
        engine.pipeline._pacer.short_of_a_step = lambda: short() and (loop_short.set() or True)
        engine.pipeline.enqueue = lambda sub, part: (
            part.first and loop_short.wait(5),
            enqueue(sub, part),
        )
        got = engine.pool(inputs, pooling="mean", normalize=False)
    kinds = [kind for kind, _ in events]
    assert kinds[:3] == ["submit", "submit", "collect"], events
    steps = [tokens for kind, tokens in events if kind == "submit"]
    assert sum(steps) == sum(map(len, inputs))
    assert steps[0] <= budget // 2, steps
    assert all(budget - longest < tokens <= budget for tokens in steps[1:-1]), steps
    ref = reference(bert_path)
    for i in (0, 1, FIRST_SLICE_IDS - 1, FIRST_SLICE_IDS, n - 1):  # both slices
        want = ref.pooled(inputs[i].tolist(), "mean")
        assert float(cosine(got[i], want).min()) >= MIN_COSINE, i


def test_a_caller_prepares_its_next_slice_once_less_than_a_step_waits(
    bert_path, reference, monkeypatch
):
    """A call of three slices, each many steps long: after each slice the caller waits until
    the backlog (tokens enqueued and not yet handed to the stages) is under one step before
    it prepares the next, so it does not contend with the loop thread for the GIL while the
    loop has a step to build. The wait is bounded; here the bound is widened so the order is
    certain on a slow machine."""
    monkeypatch.setattr(pipepool.driver.pacing, "_PACE_S", 10.0)
    rng = np.random.default_rng(1)
    n = FIRST_SLICE_IDS + SLICE + 52
    slices = list(_slice_bounds(n, None, FIRST_SLICE_IDS))
    inputs = [rng.integers(1000, 2000, size=int(k)) for k in rng.integers(3, 8, size=n)]
    step = 256
    backlog_at_slice = []
    with pipepool.Engine(str(bert_path), device="cpu", max_num_batched_tokens=step) as engine:
        enqueue = engine.pipeline.enqueue

        def recording(submission, part):
            backlog_at_slice.append(engine.pipeline._pacer.backlog_tokens)
            enqueue(submission, part)

        engine.pipeline.enqueue = recording
        got = engine.pool(inputs, pooling="mean", normalize=False)
        assert engine.pipeline._pacer.backlog_tokens == 0
    assert len(backlog_at_slice) == len(slices) == 3 and backlog_at_slice[0] == 0
    assert all(0 <= tokens < step for tokens in backlog_at_slice[1:]), backlog_at_slice
    ref = reference(bert_path)
    for i in [lo for lo, _ in slices] + [n - 1]:  # every slice
        want = ref.pooled(inputs[i].tolist(), "mean")
        assert float(cosine(got[i], want).min()) >= MIN_COSINE, i


def test_slices_grow_from_the_first_doubling_up_to_the_largest(monkeypatch):
    """A small first slice starts the device soon; each later one, twice the last, is
    prepared while the device runs the steps of the slices before; ``slice_size`` fixes them."""
    monkeypatch.setattr(pipepool.intake.inputs, "FIRST_SLICE", 4)
    monkeypatch.setattr(pipepool.intake.inputs, "SLICE", 16)
    assert list(_slice_bounds(50, None)) == [(0, 4), (4, 12), (12, 28), (28, 44), (44, 50)]
    assert list(_slice_bounds(3, None)) == [(0, 3)]
    assert list(_slice_bounds(10, 4)) == [(0, 4), (4, 8), (8, 10)]
    assert list(_slice_bounds(40, None, 8)) == [(0, 8), (8, 24), (24, 40)]  # token-id inputs


def test_result_callbacks_get_the_calls_own_rows_not_the_steps_buffer():
    """On CUDA a step's vectors reach the driver as views of a pinned buffer that goes back to
    torch's cache once delivered: a result callback (a replica forwarding rows to its front
    end, later) gets the rows as written into the call's result, not that buffer."""
    from pipepool.core.request import PoolingParams
    from pipepool.core.submission import Submission

    seen = []
    submission = Submission(
        PoolingParams("mean"), 4, 3, on_cancel=lambda s: None,
        on_result=lambda rows, values: seen.append((rows, values)),
    )  # fmt: skip
    step = np.arange(8, dtype=np.float32).reshape(2, 4)  # zero-padded past the 3 dimensions
    submission.put_vectors(np.array([1, 2]), step)
    submission.put_vectors(np.array([3, 0]), step + 10)  # rows out of order: a fancy index
    step[:] = -1  # the buffer reused
    assert [rows.tolist() for rows, _ in seen] == [[1, 2], [3, 0]]
    assert seen[0][1].tolist() == [[0, 1, 2], [4, 5, 6]]
    assert seen[1][1].tolist() == [[10, 11, 12], [14, 15, 16]]
    assert submission.result(timeout=1).tolist() == [
        [14, 15, 16], [0, 1, 2], [4, 5, 6], [10, 11, 12],
    ]  # fmt: skip
