"""``pipepool bench``: engine vs Hugging Face transformers on token-id workloads (W1-W4), or
vs ``SentenceTransformer.encode`` on text workloads (T4-T6), same weights, same device, same
run; with --cpu-peers, vs sentence-transformers and ONNX Runtime on the CPU (``cpu_peers``).
Prints a table and, with --json, writes the rows; progress lines (each phase, each pass) go to
stderr."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

from ..api.engine import Engine
from ..driver.local import LocalPipeline
from ..errors import InvalidInputError
from ..loading.deployment import Deployment, flops_per_token, plan_deployment
from ..loading.model_folder import model_display_name
from ..loading.weights import Checkpoint
from ..models import family_of
from ..stage.runner import StageRunner
from . import cpu_peers
from .common import add_engine_args, engine_config
from .workloads import (
    RAW_SCORES,
    TEXT_WORKLOADS,
    WORKLOADS,
    GpuBusy,
    OnPass,
    Peer,
    engine_outputs,
    flops,
    free_device_memory,
    gpu_busy,
    make_texts,
    make_workload,
    median_run,
    run_engine,
    run_engine_text,
    run_peer,
    run_sentence_transformers,
    vocabulary_words,
    warm_up,
    write_json,
)

# bf16 matmul (8192^3) measured on the H200 machine (GPU-NOTES.md): the "fraction of peak" base.
DEFAULT_PEAK_TFLOPS = 792.0


def add_parser(sub, help: str) -> None:
    p = sub.add_parser("bench", help=help, description=help)
    p.add_argument(
        "--workload",
        type=_workloads,
        help="comma-separated: W1,W2,W3,W4 (token ids), T4,T5,T6 (texts) (default: W1; T5 "
        "with --cpu-peers)",
    )
    p.add_argument(
        "--requests",
        type=_positive_int,
        metavar="N",
        help="use only the first N requests (texts for T4-T6) of each workload",
    )
    p.add_argument(
        "--peer-batch-sizes",
        type=_sizes,
        default="32,64,128",
        help="the peer runs at its best of these (default: 32,64,128)",
    )
    p.add_argument("--no-peer", action="store_true", help="engine figures only")
    p.add_argument(
        "--e2e",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also text inputs (tokenization included)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=DEFAULT_PEAK_TFLOPS,
        help=f"one GPU's peak, the base of 'of peak' (default: {DEFAULT_PEAK_TFLOPS:g}, an "
        "H200's bf16 matmul as measured)",
    )
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument(
        "--st-batch-sizes",
        type=_sizes,
        default="32,64,128,256,512",
        help="SentenceTransformer.encode runs at its best of these (text workloads; default: "
        "32,64,128,256,512)",
    )
    p.add_argument(
        "--gpu-busy",
        type=int,
        nargs="?",
        const=5,
        metavar="PASSES",
        help="measure the share of wall time the GPU executes (torch.profiler's kernels and "
        "copies over PASSES more passes back to back, 5 unless given): 'busy' of those "
        "profiled passes' wall, 'busy*' of the median timed pass's (the profiler slows a "
        "host-bound pass itself, its first launches most)",
    )
    p.add_argument("--profile", action="store_true", help="print where the engine's time goes")
    # A long workload on a large model (8B W1: ~25 s a pass) needs neither several warm-up
    # passes nor a median to be steady, and a GPU session's minutes are counted.
    p.add_argument(
        "--passes",
        type=_positive_int,
        default=3,
        help="timed passes (the figure is their median; default: 3)",
    )
    p.add_argument(
        "--warm-up-passes",
        type=_positive_int,
        default=6,
        help="at most this many warm-up passes (they stop once a pass takes as long as the "
        "last; default: 6)",
    )
    # bench measures what a GPU deployment runs (bfloat16), with a KV cache sized for the run
    # rather than for the GPU's memory (``bench_one``).
    own = {
        "dtype": "bfloat16 on CUDA, float32 on the CPU",
        "kv_cache_tokens": "4 step budgets plus the workload's longest request",
    }
    add_engine_args(p, own_defaults=own)
    cpu_peers.add_args(p)


def _workloads(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",")]
    unknown = [n for n in names if n not in WORKLOADS and n not in TEXT_WORKLOADS]
    if unknown:
        known = ", ".join([*WORKLOADS, *TEXT_WORKLOADS])
        raise argparse.ArgumentTypeError(f"unknown workload {unknown[0]!r} (known: {known})")
    return names


def _sizes(text: str) -> list[int]:
    try:
        return [_positive_int(part) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated batch sizes (integers >= 1), got {text!r}"
        ) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    if args.cpu_peers:
        if any(name not in TEXT_WORKLOADS for name in args.workload or []):
            raise InvalidInputError("--cpu-peers runs text workloads only (T4, T5, T6)")
        return cpu_peers.run(args)
    config = engine_config(args)
    if args.dtype is None and torch.cuda.is_available():
        config = config.replace(dtype="bfloat16")
    rows = []
    names = args.workload or ["W1"]
    for name in names:
        run_one = bench_text if name in TEXT_WORKLOADS else bench_one
        rows.append(run_one(_trace_per_workload(config, name, len(names)), name, args))
        print_table(rows)
    if args.json:
        write_json(rows, args.json)
    return 0


def _trace_per_workload(config, workload: str, count: int):
    """Several workloads, one trace file each (``t.json`` -> ``t-W1.json``, ...)."""
    if not config.trace or count == 1:
        return config
    path = Path(config.trace)
    return config.replace(trace=str(path.with_name(f"{path.stem}-{workload}{path.suffix}")))


def _write_trace(engine: Engine, since_ns: int, until_ns: int) -> dict | None:
    """The timed passes' timeline: written to the trace file, summary printed, and its
    figures for the row (None without tracing)."""
    if not engine.config.trace:
        return None
    summary = engine.write_trace(since_ns=since_ns, until_ns=until_ns)
    print(f"{summary.text()}\ntrace of the timed passes written to {engine.config.trace}")
    return summary.as_dict()


def _join(sizes: list[int]) -> str:
    return ",".join(map(str, sizes))


def _progress(workload: str) -> Callable[[str], None]:
    """Prints a progress line on stderr (stdout keeps the table): a long run (T4's 8,192 texts
    on a 2-core CPU: half an hour) says what it is doing and how far it got."""

    def say(message: str) -> None:
        print(f"bench {workload}: {message}", file=sys.stderr, flush=True)

    return say


def _start_engine(config, say: Callable[[str], None]) -> tuple[Engine, float]:
    """The engine, compiled (figures of the compiled engine, not of its first seconds), and
    the seconds it took to be ready to serve."""
    say("starting the engine")
    started = time.perf_counter()
    engine = Engine.from_config(config)
    start_s = time.perf_counter() - started
    say(f"engine started in {start_s:.1f} s")
    engine.pipeline.wait_until_compiled(None)
    return engine, start_s


def _on_pass(say: Callable[[str], None], label: str, size: int, unit: str) -> OnPass:
    """A line for each pass (or each batch size of the peer), with its rate: ``size`` units
    a pass."""

    def on_pass(number: int, seconds: float) -> None:
        say(f"{label} {number}: {seconds:.2f} s ({size / seconds:,.0f} {unit}/s)")

    return on_pass


def bench_one(config, workload_name: str, args) -> dict:
    say = _progress(workload_name)
    longest = WORKLOADS[workload_name][2]
    if config.kv_cache_tokens is None:  # size the cache for the run, not for 90% of the GPU
        budget = plan_deployment(config).max_num_batched_tokens
        config = config.replace(kv_cache_tokens=4 * budget + longest)
    engine, start_s = _start_engine(config, say)
    d = engine.pipeline.deployment
    workload = make_workload(
        workload_name, d.vocab_size, max_len=d.max_model_len, requests=args.requests
    )
    lengths = [len(t) for t in workload.token_ids]
    size = workload.num_tokens
    say(f"{len(lengths):,} requests, {size:,} tokens")
    pooling = _pooling(d)
    # Warm-up passes until the pass time settles (``warm_up``), then the median of 3 passes.
    say(f"warm-up: up to {args.warm_up_passes} passes, until one takes as long as the last")
    warm_up(
        partial(engine_outputs, engine, workload.token_ids, pooling),
        args.warm_up_passes,
        on_pass=_on_pass(say, "warm-up pass", size, "tokens"),
    )
    say(f"timed: {args.passes} passes (the figure is their median)")
    busy_start = engine.pipeline.stage_busy_s()
    timed_start = time.perf_counter()
    since = time.monotonic_ns()  # the trace's clock: the timeline of the timed passes
    ours = median_run(
        partial(run_engine, engine, workload, pooling),
        args.passes,
        on_pass=_on_pass(say, "timed pass", size, "tokens"),
    )
    until = time.monotonic_ns()
    timed_s = time.perf_counter() - timed_start  # the passes, for the stages' idle share
    busy = [b - a for a, b in zip(busy_start, engine.pipeline.stage_busy_s(), strict=True)]
    trace = _write_trace(engine, since, until)
    busy_gpu = None
    if args.gpu_busy and config.data_parallel_size == 1:  # the profiler sees this process only
        say(f"GPU busy: {args.gpu_busy} profiled passes")
        busy_gpu = gpu_busy(partial(run_engine, engine, workload, pooling), args.gpu_busy)
    ours_vectors = engine_outputs(engine, workload.token_ids[:256], pooling)
    if args.profile and config.data_parallel_size == 1:
        say("profile: the first 1,024 requests under torch.profiler")
        profile(engine, workload, pooling)
    texts = None
    ours_text = None
    if args.e2e:
        # Random ids can decode to nothing (all special tokens): keep every request non-empty.
        texts = [engine.tokenizer.decode(t) or "empty" for t in workload.token_ids]
        say("e2e: one pass of the requests as texts")
        ours_text = run_engine_text(engine, texts, pooling)
    # Memory figures are the driver's own: replicas (--dp) hold theirs in other processes.
    replicas = config.data_parallel_size
    local = replicas == 1
    weights_gib = _weights_gib(engine) if local else 0.0
    # Per GPU, as the driver sees it (other stages live in other processes): memory in use.
    used_gib = [
        round(_device_used_gib(dev), 2) for dev in d.devices if local and dev.startswith("cuda")
    ]
    kv_gib = d.kv_cache_tokens * _kv_bytes_per_token(engine) / 2**30 if local else 0.0
    stats = engine.stats
    engine.close()
    del engine
    free_device_memory()

    family = family_of(d.folder.architecture)
    total_flops = flops(
        d.folder.hf_config,
        lengths,
        d.causal,
        flops_per_token(family, Checkpoint(d.folder.path, family)),
    )
    row = {
        "model": model_display_name(d.folder.path),
        "workload": workload_name,
        "requests": len(lengths),
        "tokens": int(sum(lengths)),
        "dtype": str(d.dtype).removeprefix("torch."),
        "max_num_batched_tokens": d.max_num_batched_tokens,
        "engine_tokens_per_s": round(ours.tokens_per_s),
        "engine_tflops": round(total_flops / ours.seconds / 1e12, 1),
        # of the peak of every GPU the pipeline uses
        "engine_fraction_of_peak": round(
            total_flops / ours.seconds / 1e12 / (args.peak_tflops * d.num_stages * replicas), 3
        ),
        "engine_peak_memory_gib": round(ours.peak_memory_gib, 2),
        "engine_weights_gib": round(weights_gib, 2),
        "engine_kv_cache_gib": round(kv_gib, 2),
        "engine_working_set_gib": round(ours.peak_memory_gib - weights_gib - kv_gib, 2),
        "engine_steps": stats.steps,
        "engine_start_s": round(start_s, 2),
        **_busy_fields(busy_gpu, ours.seconds),
        "stages": d.num_stages,
        "replicas": replicas,
        "gpu_used_gib_per_stage": used_gib,
        "stage_idle_fraction": [round(max(0.0, 1 - b / timed_s), 3) for b in busy],
        "trace": trace,
    }
    if ours_text is not None:
        row["engine_text_tokens_per_s"] = round(ours_text.tokens_per_s)
    if not args.no_peer:
        sizes = args.peer_batch_sizes
        say(f"peer: transformers at batch sizes {_join(sizes)}, one pass each")
        peer = Peer(str(d.folder.path), d.dtype, d.devices[0], pooling)
        theirs = run_peer(
            peer, workload, pooling, sizes, on_size=_on_pass(say, "peer batch size", size, "tokens")
        )
        peer_vectors = peer.encode_ids(
            workload.token_ids[:256], pooling, theirs.detail["batch_size"]
        )
        row.update(
            peer_tokens_per_s=round(theirs.tokens_per_s),
            peer_batch_size=theirs.detail["batch_size"],
            peer_tokens_per_s_by_batch_size=theirs.detail["tokens_per_s_by_batch_size"],
            peer_tflops=round(total_flops / theirs.seconds / 1e12, 1),
            peer_peak_memory_gib=round(theirs.peak_memory_gib, 2),
            ratio=round(ours.tokens_per_s / theirs.tokens_per_s, 2),
            **_agreement(ours_vectors, peer_vectors, pooling),
        )
        if texts is not None:
            say("peer e2e: one pass of the requests as texts")
            start = time.perf_counter()
            _, tokens = peer.encode_texts(
                texts, pooling, theirs.detail["batch_size"], d.max_model_len
            )
            row["peer_text_tokens_per_s"] = round(tokens / (time.perf_counter() - start))
            row["text_ratio"] = round(
                row["engine_text_tokens_per_s"] / row["peer_text_tokens_per_s"], 2
            )
        del peer
        free_device_memory()
    return row


def _pooling(d: Deployment) -> str:
    """What a run of the model gives: its pooled vectors, or a sequence classifier's raw
    scores; a token classifier is refused (its outputs are per token)."""
    if d.classifier is None:
        return d.pooling
    if d.classifier.per_token:
        raise InvalidInputError(
            "bench measures embedding models and sequence classifiers; "
            f"{d.folder.architecture} classifies tokens"
        )
    return RAW_SCORES


def _agreement(ours: np.ndarray, peer: np.ndarray, pooling: str) -> dict:
    """The engine against the peer on the same requests: the smallest cosine of normalised
    vectors, or the largest difference of raw scores."""
    if pooling == RAW_SCORES:
        return {"max_score_diff_engine_vs_peer": round(float(np.abs(ours - peer).max()), 6)}
    return {"min_cosine_engine_vs_peer": round(float((ours * peer).sum(-1).min()), 5)}


def _busy_fields(busy: GpuBusy | None, timed_s: float) -> dict:
    """The GPU's busy share of the profiled passes, of their own wall and of the wall of the
    median pass timed without the profiler (``GpuBusy``); milliseconds are a pass's."""
    if busy is None:
        return {"gpu_busy_fraction": None}
    return {
        "gpu_busy_fraction": round(busy.fraction, 3),
        "gpu_busy_fraction_of_timed_wall": round(busy.fraction_of(timed_s), 3),
        "gpu_busy_passes": busy.passes,
        "gpu_busy_ms": round(busy.busy_s / busy.passes * 1e3, 2),
        "gpu_busy_profiled_wall_ms": round(busy.profiled_wall_s / busy.passes * 1e3, 2),
    }


def bench_text(config, workload_name: str, args) -> dict:
    """Texts in, vectors out, tokenisation included: the engine's ``embed`` against
    ``SentenceTransformer.encode`` on the same texts (the model folder must be one that
    sentence-transformers loads with the same pooling)."""
    say = _progress(workload_name)
    engine, start_s = _start_engine(config, say)
    d = engine.pipeline.deployment
    words = vocabulary_words(d.folder.tokenizer_file)
    texts = make_texts(workload_name, words, requests=args.requests)
    size = len(texts)
    say(f"{size:,} texts")
    say(f"warm-up: up to {args.warm_up_passes} passes, until one takes as long as the last")
    warm_up(
        partial(engine.embed, texts),
        args.warm_up_passes,
        on_pass=_on_pass(say, "warm-up pass", size, "texts"),
    )
    say(f"timed: {args.passes} passes (the figure is their median)")
    since = time.monotonic_ns()
    ours = median_run(
        partial(run_engine_text, engine, texts, d.pooling),
        args.passes,
        on_pass=_on_pass(say, "timed pass", size, "texts"),
    )
    trace = _write_trace(engine, since, time.monotonic_ns())
    busy_gpu = None
    if args.gpu_busy:
        say(f"GPU busy: {args.gpu_busy} profiled passes")
        busy_gpu = gpu_busy(partial(run_engine_text, engine, texts, d.pooling), args.gpu_busy)
    engine.close()
    del engine
    free_device_memory()
    row = {
        "model": model_display_name(d.folder.path),
        "workload": workload_name,
        "requests": len(texts),
        "tokens": ours.detail["tokens"],
        "dtype": str(d.dtype).removeprefix("torch."),
        "max_num_batched_tokens": d.max_num_batched_tokens,
        "engine_texts_per_s": round(len(texts) / ours.seconds, 1),
        "engine_tokens_per_s": round(ours.tokens_per_s),
        "engine_start_s": round(start_s, 2),
        **_busy_fields(busy_gpu, ours.seconds),
        "trace": trace,
    }
    if not args.no_peer:
        sizes = args.st_batch_sizes
        say(f"peer: SentenceTransformer.encode at batch sizes {_join(sizes)}, one pass each")
        theirs = run_sentence_transformers(
            str(d.folder.path),
            texts,
            dtype=d.dtype,
            device=d.devices[0],
            batch_sizes=sizes,
            on_size=_on_pass(say, "peer batch size", size, "texts"),
        )
        a, b = ours.detail["vectors"], theirs.detail["vectors"]
        cos = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
        row.update(
            peer="SentenceTransformer.encode",
            peer_texts_per_s=round(len(texts) / theirs.seconds, 1),
            peer_batch_size=theirs.detail["batch_size"],
            peer_texts_per_s_by_batch_size=theirs.detail["texts_per_s_by_batch_size"],
            ratio=round(theirs.seconds / ours.seconds, 2),
            min_cosine_engine_vs_peer=round(float(cos.min()), 5),
        )
    return row


def profile(engine: Engine, workload, pooling: str) -> None:
    """Kernel time by operator over a slice of the workload (torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with torch_profile(activities=activities) as prof:
        engine_outputs(engine, workload.token_ids[:1024], pooling)
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=25), flush=True)


def _device_used_gib(device: str) -> float:
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return (total - free) / 2**30


def _stage0(engine: Engine) -> StageRunner:
    """The driver's stage runner: the pipeline's in this process (no replicas)."""
    pipeline = engine.pipeline
    assert isinstance(pipeline, LocalPipeline), "replicas keep their runners in their processes"
    return pipeline.runners[0]


def _weights_gib(engine: Engine) -> float:
    """Weights of stage 0 (all of them with one stage)."""
    model = _stage0(engine).model
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30


def _kv_bytes_per_token(engine: Engine) -> int:
    cache = _stage0(engine).kv_cache
    if cache is None:
        return 0
    return cache.storage[0, :, 0].numel() * cache.storage.element_size() * cache.storage.shape[0]


# (row key, column heading, width)
_COLUMNS = [
    ("model", "model", 18),
    ("workload", "wl", 4),
    ("tokens", "tokens", 9),
    ("engine_tokens_per_s", "engine tok/s", 12),
    ("peer_tokens_per_s", "peer tok/s", 11),
    ("engine_texts_per_s", "engine txt/s", 12),
    ("peer_texts_per_s", "peer txt/s", 11),
    ("ratio", "ratio", 6),
    ("gpu_busy_fraction", "busy", 6),
    ("gpu_busy_fraction_of_timed_wall", "busy*", 6),
    ("engine_start_s", "start s", 8),
    ("engine_tflops", "TFLOP/s", 8),
    ("engine_fraction_of_peak", "of peak", 8),
    ("engine_peak_memory_gib", "GiB", 7),
    ("peer_peak_memory_gib", "peer GiB", 9),
    ("min_cosine_engine_vs_peer", "cos", 8),
    ("max_score_diff_engine_vs_peer", "diff", 9),
]


def print_table(rows: list[dict]) -> None:
    print(" ".join(head.ljust(w) for _, head, w in _COLUMNS))
    for row in rows:
        print(" ".join(str(row.get(key, "-")).ljust(w) for key, _, w in _COLUMNS))
    sys.stdout.flush()
