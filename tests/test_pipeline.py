"""Issue 3 acceptance: real multi-process pipelines (gloo on CPU), in lockstep, against
transformers, with the historical bug injected and stage processes killed."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import faults
import pytest
from tiny_models import MIN_COSINE, REPRODUCER_PROMPTS, cosine, long_prompts

import pipepool
from pipepool import EngineDeadError, StageFailure, StateDivergence

# Slow: pipelines of stage processes, killed and restarted.
pytestmark = pytest.mark.slow

POOLINGS = ("last", "mean", "cls", "all")


def _stage_pids(engine) -> list[int]:
    return [p.pid for p in engine.pipeline._executor._procs.values()]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # Still in the process table: only acceptable as an unreaped zombie of someone else.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] == "Z"


def _all_gone_within(pids: list[int], *, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return all(_gone(pid) for pid in pids)


def _returns(fn, timeout: float = 60.0) -> None:
    """``fn()`` returns (it does not hang): run it in a thread and wait for it."""
    done = threading.Event()
    errors = []

    def call() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=call, daemon=True).start()
    assert done.wait(timeout), f"{fn} still running after {timeout} s"
    if errors:
        raise errors[0]


def _per_request_min_cosine(outs, refs) -> float:
    return min(float(cosine(o, r).min()) for o, r in zip(outs, refs, strict=True))


def test_published_reproducer_pp2_matches_pp1_and_transformers(qwen3_path, reference):
    """docs/design.md §1: five mixed prompts, budget 64, five seqs, PP=2, LAST pooling."""
    ref = reference(qwen3_path)
    lengths = [len(ref.token_ids(p)) for p in REPRODUCER_PROMPTS]
    assert max(lengths) > 64, f"the reproducer must chunk; lengths {lengths}"
    expected = [ref.pooled(ref.token_ids(p), "last") for p in REPRODUCER_PROMPTS]
    kw = dict(max_num_batched_tokens=64, max_num_seqs=5, pooling="last", normalize=False)
    with pipepool.Engine(str(qwen3_path), **kw) as pp1:
        one_stage = pp1.embed(REPRODUCER_PROMPTS)
    with pipepool.Engine(str(qwen3_path), pipeline_parallel_size=2, **kw) as pp2:
        two_stages = pp2.embed(REPRODUCER_PROMPTS)
        assert pp2.stats.chunked_requests >= 1
    assert _per_request_min_cosine(two_stages, one_stage) >= MIN_COSINE
    assert _per_request_min_cosine(two_stages, expected) >= MIN_COSINE


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("budget", [7, 64])
def test_pp_stages_match_transformers_for_every_pooler(qwen3_path, reference, pp, budget):
    ref = reference(qwen3_path)
    prompts = long_prompts()
    with pipepool.Engine(
        str(qwen3_path), pipeline_parallel_size=pp, max_num_batched_tokens=budget, max_num_seqs=6
    ) as engine:
        assert engine.info.num_stages == pp
        for pooling in POOLINGS:
            outs = engine.pool(prompts, pooling=pooling, normalize=False)
            refs = [ref.pooled(ref.token_ids(p), pooling) for p in prompts]
            worst = _per_request_min_cosine(outs, refs)  # per token for "all"
            assert worst >= MIN_COSINE, f"pp={pp} budget={budget} {pooling}: {worst}"
        assert engine.stats.chunked_requests > 0
        assert len(engine.stats.stage_busy_s) == pp


@pytest.mark.parametrize("pp", [1, 2])
def test_a_capped_first_step_chunks_and_matches_transformers(qwen3_path, reference, pp):
    """Steps overlapping (CUDA's default, forced here on the CPU): the step that starts an idle
    pipeline holds at most half the budget, so the long prompts' first chunks are cut at it and
    their next chunks at the whole budget; every pooler still agrees with transformers."""
    ref = reference(qwen3_path)
    prompts = long_prompts()
    budget = 16
    with pipepool.Engine(
        str(qwen3_path), pipeline_parallel_size=pp, max_num_batched_tokens=budget,
        overlap_steps=True, normalize=False,
    ) as engine:  # fmt: skip
        steps = []  # (the budget asked for, the plan's tokens)
        schedule = engine.pipeline._scheduler.schedule

        def recording(max_tokens=None):
            plan = schedule(max_tokens)
            if plan is not None:
                steps.append((max_tokens, plan.num_tokens))
            return plan

        engine.pipeline._scheduler.schedule = recording
        for pooling in POOLINGS:
            outs = engine.pool(prompts, pooling=pooling)
            refs = [ref.pooled(ref.token_ids(p), pooling) for p in prompts]
            worst = _per_request_min_cosine(outs, refs)  # per token for "all"
            assert worst >= MIN_COSINE, f"pp={pp} {pooling}: {worst}"
        assert engine.stats.chunked_requests > 0
    capped = [tokens for asked, tokens in steps if asked is not None]
    assert len(capped) >= len(POOLINGS) and max(capped) == budget // 2, steps  # each call's first
    assert max(tokens for asked, tokens in steps if asked is None) == budget, steps


def test_pp_with_explicit_partition(decoder_paths, reference):
    path = decoder_paths["llama"]
    ref = reference(path)
    prompts = long_prompts()
    with pipepool.Engine(
        str(path), pipeline_parallel_size=2, pp_partition=(1, 3), max_num_batched_tokens=16
    ) as engine:
        assert [len(r) for r in engine.pipeline.deployment.layers] == [1, 3]
        outs = engine.pool(prompts, pooling="mean", normalize=False)
    refs = [ref.pooled(ref.token_ids(p), "mean") for p in prompts]
    assert _per_request_min_cosine(outs, refs) >= MIN_COSINE


def test_minilm_pp2_matches_sentence_transformers(minilm_path):
    from sentence_transformers import SentenceTransformer
    from tiny_models import SENTENCES

    expected = SentenceTransformer(str(minilm_path), device="cpu").encode(SENTENCES)
    with pipepool.Engine(pipeline_parallel_size=2, max_num_batched_tokens=128) as engine:
        got = engine.embed(SENTENCES)
    assert cosine(got, expected).min() >= MIN_COSINE


@pytest.mark.parametrize("backend", ["mp", "inproc"])
def test_skipped_post_step_raises_state_divergence_on_first_affected_step(
    qwen3_path, backend, monkeypatch
):
    """The original bug, injected: stage 0 skips its post-step. The next stage's check of the
    digest it receives catches it in the very step the state first drifts, before any vector
    is returned."""
    faults.install(monkeypatch, "skip_post_step_on_non_last_stage")
    engine = pipepool.Engine(
        str(qwen3_path),
        pipeline_parallel_size=2,
        max_num_batched_tokens=64,
        max_num_seqs=5,
        pipeline_backend=backend,
    )
    pids = _stage_pids(engine) if backend == "mp" else []
    try:
        with pytest.raises(StateDivergence) as info:
            engine.embed(REPRODUCER_PROMPTS)
        err = info.value
        assert err.step_id == 0 and err.stage == 0
        assert (err.check, err.found_by) == ("neighbour", "stage 1")
        assert "state divergence at step 0, stage 0: num_computed_tokens" in str(err)
        with pytest.raises(EngineDeadError, match="state divergence"):
            engine.embed(["after the failure"])
    finally:
        engine.close()
    assert all(_gone(pid) for pid in pids)


def test_positions_come_from_the_plan_even_with_the_checks_off(qwen3_path, reference, monkeypatch):
    """With verify_state off, the historical bug (stage 0 never advances its mirror) cannot
    move positions or KV slots any more: they come from the plan, so vectors stay right."""
    ref = reference(qwen3_path)
    expected = [ref.pooled(ref.token_ids(p), "last") for p in REPRODUCER_PROMPTS]
    faults.install(monkeypatch, "skip_post_step_on_non_last_stage")
    with pipepool.Engine(
        str(qwen3_path),
        pipeline_parallel_size=2,
        max_num_batched_tokens=64,
        max_num_seqs=5,
        verify_state=False,
        pipeline_backend="inproc",
        normalize=False,
    ) as engine:
        got = engine.embed(REPRODUCER_PROMPTS)
        assert engine.stats.chunked_requests >= 1
    assert _per_request_min_cosine(got, expected) >= MIN_COSINE


def test_killed_stage_without_restarts_fails_every_request_fast_and_leaves_no_process(
    qwen3_path,
):
    engine = pipepool.Engine(
        str(qwen3_path),
        pipeline_parallel_size=3,
        max_num_batched_tokens=7,
        max_num_seqs=2,
        stage_restarts=0,
    )
    pids = _stage_pids(engine)
    submission = engine.submit(long_prompts() * 20)
    started = threading.Event()
    submission.add_progress_callback(lambda n: started.set())
    assert started.wait(30)  # well into the run: some requests are back
    os.kill(pids[0], signal.SIGKILL)  # stage 1
    error = submission.exception(timeout=60)  # the call fails, it does not hang
    assert isinstance(error, StageFailure) and "stage 1" in str(error), error
    assert 0 < submission.num_done < submission.num_inputs // 2
    with pytest.raises(EngineDeadError, match="stage 1"):
        engine.embed(["later request"])
    _returns(engine.close)
    assert all(_gone(pid) for pid in pids)


def test_stage_that_raises_fails_requests_with_its_error(qwen3_path, monkeypatch):
    faults.install(monkeypatch, "raise_on_stage", stage=1, step=2)
    engine = pipepool.Engine(
        str(qwen3_path),
        pipeline_parallel_size=2,
        max_num_batched_tokens=16,
        stage_restarts=0,
    )
    pids = _stage_pids(engine)
    try:
        with pytest.raises(StageFailure, match="injected failure on stage 1 at step 2"):
            engine.embed(long_prompts())
    finally:
        engine.close()
    assert all(_gone(pid) for pid in pids)


def test_killed_stages_are_restarted_and_every_request_still_matches(qwen3_path):
    """A stage process dies mid-call, twice (stage 1, then stage 2 of the new pipeline): the
    engine starts the stages again and runs the unfinished requests once more; the caller
    gets every vector, the same as an engine nobody killed."""
    prompts = [f"{i} {p}" for i in range(5) for p in long_prompts()]
    with pipepool.Engine(str(qwen3_path), max_num_batched_tokens=7, normalize=False) as ref:
        want = ref.embed(prompts)
    engine = pipepool.Engine(
        str(qwen3_path),
        pipeline_parallel_size=3,
        max_num_batched_tokens=7,
        max_num_seqs=2,
        normalize=False,
    )
    engine.pipeline._restarts.first_delay_s = 0.01
    with engine:
        for victim in (0, 1):
            submission = engine.submit(prompts)
            started = threading.Event()
            submission.add_progress_callback(lambda n, started=started: started.set())
            assert started.wait(60)
            killed = _stage_pids(engine)[victim]
            os.kill(killed, signal.SIGKILL)
            got = submission.result(timeout=180)
            assert _per_request_min_cosine(got, want) >= MIN_COSINE
            assert killed not in _stage_pids(engine)
        assert engine.stats.pipeline_restarts == 2
        assert engine.stats.requests_retried > 0
        assert engine.stats.requests_finished == 2 * len(prompts)
        assert engine.pipeline.kv_blocks_free == engine.pipeline.deployment.num_kv_blocks
        # counted again from the requests run again
        assert engine.pipeline._pacer.backlog_tokens == 0
        assert engine.health == "ok"
        pids = _stage_pids(engine)
    assert all(_gone(pid) for pid in pids)


def test_a_hung_stage_is_declared_by_the_watchdog_and_the_pipeline_heals(qwen3_path):
    """A stage process stopped (SIGSTOP) mid-call answers nothing while its process lives on:
    once a step is ``step_timeout_s`` (+ 10 ms a token) overdue the watchdog kills the stages,
    health turns degraded, the pipeline restarts and every request is answered, as for a
    killed stage."""
    prompts = [f"{i} {p}" for i in range(3) for p in long_prompts()]
    with pipepool.Engine(str(qwen3_path), max_num_batched_tokens=7, normalize=False) as ref:
        want = ref.embed(prompts)
    engine = pipepool.Engine(
        str(qwen3_path), pipeline_parallel_size=2, max_num_batched_tokens=7, normalize=False,
        step_timeout_s=1.0,
    )  # fmt: skip
    engine.pipeline._restarts.first_delay_s = 0.01
    degraded = threading.Event()
    with engine:
        engine.embed(["a first step, unbounded: it may compile"])
        submission = engine.submit(prompts)
        started = threading.Event()
        submission.add_progress_callback(lambda n: started.set())
        assert started.wait(60)
        stopped = _stage_pids(engine)[0]
        os.kill(stopped, signal.SIGSTOP)
        try:
            while not submission.done() and not degraded.is_set():
                if engine.health == "degraded":
                    degraded.set()
                futures.wait([submission], timeout=0.05)  # health is polled: no event
            got = submission.result(timeout=180)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGCONT)
        assert degraded.is_set()
        assert _per_request_min_cosine(got, want) >= MIN_COSINE
        assert engine.stats.pipeline_restarts == 1
        assert stopped not in _stage_pids(engine)
        assert engine.health == "ok"


def test_slow_steps_the_learnt_bound_allows_do_not_fire_the_watchdog(qwen3_path, monkeypatch):
    """The default (learnt) bound, its numbers scaled down tenfold so the test is quick: a first
    step that compiles (unbounded), a slow step among the first results (warm-up room) and,
    once steps take 0.1 s, a step of 0.8 s (ten times the longest recent wait) are waited for:
    no restart, every answer right. The same floor alone (0.3 s) would fire at each of them."""
    from pipepool.driver.watchdog import WaitBound

    monkeypatch.setattr(WaitBound, "FLOOR_S", 0.3)
    monkeypatch.setattr(WaitBound, "WARMUP_S", 1.2)
    monkeypatch.setattr(WaitBound, "WINDOW", 6)  # the warm-up's waits are forgotten by step 24
    steady = dict.fromkeys(range(12, 24), 0.1)
    sleeps = {0: 1.5, 3: 0.8, **steady, 24: 0.8}
    faults.install(monkeypatch, "sleep_on_stage", stage=1, sleeps=sleeps)
    prompts = [f"{i} {p}" for i in range(2) for p in long_prompts()]
    with pipepool.Engine(str(qwen3_path), max_num_batched_tokens=7, normalize=False) as ref:
        want = ref.embed(prompts)
    engine = pipepool.Engine(
        str(qwen3_path), pipeline_parallel_size=2, max_num_batched_tokens=7, normalize=False
    )
    assert engine.config.step_timeout_s is None  # the default: learnt
    with engine:
        got = engine.embed(prompts)
        assert engine.stats.steps > max(sleeps)  # every listed sleep was slept
        assert engine.stats.pipeline_restarts == 0
        assert _per_request_min_cosine(got, want) >= MIN_COSINE


def test_a_stage_that_keeps_failing_is_given_up_on_after_the_restart_limit(qwen3_path, monkeypatch):
    # Every fresh pipeline fails again at its step 2.
    faults.install(monkeypatch, "raise_on_stage", stage=1, step=2)
    engine = pipepool.Engine(
        str(qwen3_path),
        pipeline_parallel_size=2,
        max_num_batched_tokens=16,
        stage_restarts=2,
    )
    engine.pipeline._restarts.first_delay_s = 0.01
    deaths = []
    engine.pipeline.add_death_callback(deaths.append)
    with engine:
        with pytest.raises(StageFailure, match="injected failure on stage 1 at step 2"):
            engine.embed(long_prompts())
        assert engine.stats.pipeline_restarts == 2
        assert engine.health == "dead"
        assert len(deaths) == 1 and "injected failure" in str(deaths[0])
        with pytest.raises(EngineDeadError, match="injected failure"):
            engine.embed(["later request"])


def test_a_stage_killed_while_idle_is_replaced_before_any_request(qwen3_path):
    with pipepool.Engine(str(qwen3_path), pipeline_parallel_size=2) as engine:
        engine.pipeline._restarts.first_delay_s = 0.01
        engine.embed(["warm"])
        (old,) = _stage_pids(engine)
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not (engine.stats.pipeline_restarts and engine.health == "ok"):
            assert time.monotonic() < deadline, engine.health
            time.sleep(0.05)
        assert _stage_pids(engine) != [old]
        assert engine.embed(["after the restart"]).shape == (1, 64)


def test_health_is_degraded_while_restarting_and_close_interrupts_the_restart(qwen3_path):
    engine = pipepool.Engine(str(qwen3_path), pipeline_parallel_size=2)
    engine.pipeline._restarts.first_delay_s = (
        120.0  # the restart waits: health can be read meanwhile
    )
    engine.embed(["warm"])
    assert engine.health == "ok"
    os.kill(_stage_pids(engine)[0], signal.SIGKILL)
    deadline = time.monotonic() + 20
    while engine.health != "degraded" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.health == "degraded"
    waiting = engine.submit(["waits for the restart"])  # accepted: it will run once healed
    _returns(engine.close)  # without waiting out the restart's 120 s pause
    assert isinstance(waiting.exception(timeout=30), EngineDeadError)
    assert engine.health == "closed"


def test_close_is_prompt_with_steps_in_flight_and_stages_exit_cleanly(qwen3_path):
    """close() with plans in flight (the last stage may be blocked handing over results
    nobody reads): under a second, pending calls fail with "engine closed", and every stage
    process exits by itself with code 0 (none is killed)."""
    engine = pipepool.Engine(str(qwen3_path), pipeline_parallel_size=3, max_num_batched_tokens=8)
    procs = list(engine.pipeline._executor._procs.values())
    submission = engine.submit(long_prompts() * 10)
    started = threading.Event()
    submission.add_progress_callback(lambda n: started.set())
    assert started.wait(60)
    assert not submission.done()
    _returns(engine.close)  # how fast: benchmarks/ctrl_c.py
    error = submission.exception(timeout=30)
    assert isinstance(error, EngineDeadError) and str(error) == "engine closed"
    assert [p.returncode for p in procs] == [0, 0]
    assert all(_gone(p.pid) for p in procs)


def test_two_pp2_engines_at_once_on_one_host(qwen3_path, bert_path, reference):
    results = {}

    def run(name, path, pooling):
        with pipepool.Engine(
            str(path), pipeline_parallel_size=2, max_num_batched_tokens=32, normalize=False
        ) as engine:
            results[name] = engine.pool(long_prompts(), pooling=pooling, normalize=False)

    threads = [
        threading.Thread(target=run, args=("qwen3", qwen3_path, "last")),
        threading.Thread(target=run, args=("bert", bert_path, "cls")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for name, path, pooling in (("qwen3", qwen3_path, "last"), ("bert", bert_path, "cls")):
        ref = reference(path)
        refs = [ref.pooled(ref.token_ids(p), pooling) for p in long_prompts()]
        assert _per_request_min_cosine(results[name], refs) >= MIN_COSINE


_CTRL_C_SCRIPT = """
import faulthandler, signal, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's view into a hang
# A test run started as a background job inherits SIGINT ignored (the shell does that without
# job control) and Python then leaves it ignored; a terminal's program has Python's handler.
signal.signal(signal.SIGINT, signal.default_int_handler)
import pipepool
engine = pipepool.Engine(sys.argv[1], pipeline_parallel_size=2, max_num_batched_tokens=8)
print(" ".join(str(p.pid) for p in engine.pipeline._executor._procs.values()), flush=True)
try:
    with engine:
        engine.embed(["keep the pipeline busy " * 20])
        print("busy", flush=True)
        while True:
            engine.embed(["keep the pipeline busy " * 20])
except KeyboardInterrupt:
    print("closed", time.monotonic(), flush=True)  # the with block closed the engine
    raise
"""


def _start_busy_driver(qwen3_path, tmp_path) -> tuple[subprocess.Popen, list[int]]:
    """A script driving a PP=2 engine in a loop; returns it and its stage pids."""
    script = tmp_path / "busy.py"
    script.write_text(_CTRL_C_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(qwen3_path)],
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "busy.err").open("w"),
        text=True,
    )
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert pids
    return proc, pids


def test_ctrl_c_is_prompt_and_leaves_no_stage_process_running(qwen3_path, tmp_path):
    proc, pids = _start_busy_driver(qwen3_path, tmp_path)
    assert proc.stdout.readline().strip() == "busy"  # steps are in flight from now on
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # dump every thread's stack, then fail with it
        time.sleep(1.0)
        proc.kill()
        pytest.fail(
            "driver still running 30 s after Ctrl-C:\n" + (tmp_path / "busy.err").read_text()
        )
    # The stages are told to stop and exit at once: the engine closes (how fast:
    # benchmarks/ctrl_c.py) and the driver dies of its KeyboardInterrupt.
    word, _closed_at = proc.stdout.readline().split()
    assert word == "closed"
    assert proc.returncode == -signal.SIGINT  # died of its KeyboardInterrupt, as Python does
    assert all(_gone(pid) for pid in pids)


_EXITS_BUSY = """
import sys
from pipepool import Engine

engine = Engine(sys.argv[1], device="cpu")
text = "keep the engine busy with a long enough input " * 12
calls = [engine.submit([text] * 8) for _ in range(60)]
calls[0].result()  # steps are running, and dozens more are queued
print("leaving", flush=True)
"""


def test_a_program_that_leaves_with_work_in_flight_exits_cleanly(minilm_path):
    """No close(), no ``with``, work queued: the program still exits 0 (it died of SIGABRT,
    "terminate called without an active exception", while the loop thread ran a step)."""
    out = subprocess.run(
        [sys.executable, "-c", _EXITS_BUSY, str(minilm_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.stdout.strip() == "leaving"
    assert out.returncode == 0, out.stderr[-2000:]
    assert "terminate called" not in out.stderr


def test_ctrl_c_stops_the_embed_command_with_its_stages(qwen3_path, tmp_path):
    """A terminal's Ctrl-C reaches the whole process group: ``pipepool embed --pp 2`` exits
    130 at once (no traceback), and no process of the group is left."""
    lines = tmp_path / "long.txt"
    lines.write_text("".join(f"line {i} {'keep the pipeline busy ' * 20}\n" for i in range(500)))
    cmd = [
        sys.executable, "-m", "pipepool", "embed", "--model", str(qwen3_path), "--pp", "2",
        "--max-num-batched-tokens", "8", "--input", str(lines), "--output",
        str(tmp_path / "out.jsonl"),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a group of its own, as a terminal's foreground job has
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    seen = ""
    # The progress bar counted a finished input (one or more: it redraws at most every 0.1 s,
    # so it may skip 1), steps in flight.
    while not re.search(r"\| *[1-9][0-9]*/[0-9]+ ", seen):
        chunk = proc.stderr.read(64)
        assert chunk, f"embed ended before computing: {seen}"
        seen = (seen + chunk)[-512:]
    os.killpg(proc.pid, signal.SIGINT)
    try:
        rest = proc.communicate(timeout=30)[1]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("pipepool embed still running 30 s after Ctrl-C")
    assert proc.returncode == 130, rest
    assert "interrupted" in rest and "Traceback" not in rest
    assert _all_gone_within(_group_members(proc.pid), seconds=5)


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[2]) == pgid:
            members.append(int(entry))
    return members


def test_no_stage_survives_its_driver_being_killed(qwen3_path, tmp_path):
    proc, pids = _start_busy_driver(qwen3_path, tmp_path)
    proc.kill()
    proc.wait(timeout=10)
    assert _all_gone_within(pids, seconds=10)


def test_stage_processes_load_only_their_own_layers(qwen3_path):
    with pipepool.Engine(
        str(qwen3_path), pipeline_parallel_size=2, pipeline_backend="inproc"
    ) as engine:
        first, last = engine.pipeline.runners
        first_params = {n for n, _ in first.model.named_parameters()}
        last_params = {n for n, _ in last.model.named_parameters()}
    assert "embed_tokens.weight" in first_params and "embed_tokens.weight" not in last_params
    assert "norm.weight" in last_params and "norm.weight" not in first_params
    assert not any(n.startswith("layers.2.") for n in first_params)
    assert not any(n.startswith("layers.0.") for n in last_params)


def test_pipeline_runs_plans_in_flight(qwen3_path):
    with pipepool.Engine(
        str(qwen3_path), pipeline_parallel_size=2, max_num_batched_tokens=16
    ) as engine:
        assert engine.pipeline._executor.depth == 2
        engine.embed(long_prompts())
        assert engine.stats.steps > 2


@pytest.mark.parametrize("pp", [2, 3])
def test_pipeline_running_ahead_matches_one_stage(qwen3_path, pp):
    """overlap_steps (the CUDA default) forced on CPU: one plan more in flight than stages,
    and the last stage holds each result back until the next plan or a flush arrives. Every
    way of releasing a held result must deliver it: a long run, one single-step request, a
    batch submitted while idle, then more requests after the pipeline drained. Poolers vary, so
    held results include token embeddings (ALL) and running sums (MEAN) across chunks."""
    batches = [
        (long_prompts(), "all"),
        (["tail"], "last"),
        (REPRODUCER_PROMPTS, "mean"),
        (long_prompts()[:2], "all"),
    ]
    with pipepool.Engine(
        str(qwen3_path),
        pipeline_parallel_size=pp,
        max_num_batched_tokens=16,
        overlap_steps=True,
        normalize=False,
    ) as engine:
        assert engine.pipeline._executor.depth == pp + 1
        got = [engine.pool(batch, pooling=pooling) for batch, pooling in batches]
        submission = engine.submit(REPRODUCER_PROMPTS, pooling="cls")
        got.append(list(submission.result(timeout=60)))
        assert engine.pipeline.kv_blocks_free == engine.pipeline._scheduler.blocks.num_blocks
    with pipepool.Engine(str(qwen3_path), max_num_batched_tokens=4096, normalize=False) as ref:
        want = [
            ref.pool(batch, pooling=pooling)
            for batch, pooling in [*batches, (REPRODUCER_PROMPTS, "cls")]
        ]
    for g, w in zip(got, want, strict=True):
        assert _per_request_min_cosine(g, w) >= MIN_COSINE


def _blocked_signals(native_id: int) -> set[int]:
    status = Path(f"/proc/self/task/{native_id}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("SigBlk:"))
    mask = int(line.split()[1], 16)
    return {n for n in range(1, 64) if mask >> (n - 1) & 1}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_stop_signals_reach_only_the_main_thread(qwen3_path):
    """Ctrl-C / SIGTERM are blocked in the engine's own threads (so the kernel delivers them to
    the main thread, never into a transport thread's system call) and not in the main thread."""
    with pipepool.Engine(str(qwen3_path), pipeline_parallel_size=2) as engine:
        engine.embed(["warm"])
        stop = {signal.SIGINT, signal.SIGTERM}
        own = {engine.pipeline._thread.native_id, engine.pipeline._executor._supervisor.native_id}
        for tid in own:
            assert stop <= _blocked_signals(tid)
        assert not stop & _blocked_signals(threading.main_thread().native_id)
        # gloo's I/O threads, started while the groups were made, inherited the mask
        masked = {int(t) for t in os.listdir("/proc/self/task") if stop <= _blocked_signals(int(t))}
        assert masked - own
