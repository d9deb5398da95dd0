"""Throughput of the engine against the peer most users run today, in the same process, on the
same weights and device: Hugging Face ``transformers`` (SDPA attention) on padded batches sorted
by length, which is what ``sentence-transformers.encode`` does; for text workloads,
``sentence_transformers.SentenceTransformer.encode`` itself, tokenisation included.

Token-id workloads (drawn with a fixed seed):
- W1: 4096 requests, lengths uniform in [16, 512]
- W2: 512 documents, lengths uniform in [1024, 8192]
- W3: one 32k-token document
- W4: 8192 short queries, log-normal lengths (median 32 tokens, sigma 0.8) clipped to [4, 256]

Text workloads (words of the model's own vocabulary, fixed seed):
- T4: 8192 queries, log-normal word counts (median 28 words, sigma 0.8) clipped to [3, 200]
- T5: 2,000 texts of 5-60 words (uniform): the "queries" of ``--cpu-peers``
- T6: 500 texts of 100-300 words (uniform): its "passages"
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..api.engine import Engine

WORKLOADS = {
    "W1": (4096, 16, 512),
    "W2": (512, 1024, 8192),
    "W3": (1, 32768, 32768),
    "W4": (8192, 4, 256),
}
LOGNORMAL = {"W4": (32, 0.8), "T4": (28, 0.8)}  # median, sigma
TEXT_WORKLOADS = {  # texts, min / max words
    "T4": (8192, 3, 200),
    "T5": (2000, 5, 60),
    "T6": (500, 100, 300),
}


# The "pooling" of a sequence classifier's run: its head's raw logits per request (no
# activation), where an embedding model's run pools and normalises.
RAW_SCORES = "raw scores"


@dataclass
class Workload:
    """A named benchmark workload: the token ids of every request, in submission order."""

    name: str
    token_ids: list[np.ndarray]

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


def make_workload(
    name: str, vocab_size: int, *, max_len: int, requests: int | None = None, seed: int = 0
) -> Workload:
    """Token ids for a named workload; lengths capped at the model's ``max_len``."""
    count, lo, hi = WORKLOADS[name]
    rng = np.random.default_rng(seed)
    lengths = np.minimum(_lengths(name, count, lo, hi, rng), max_len)
    if requests is not None:
        lengths = lengths[:requests]
    # Ids away from the low end, where vocabularies keep their special tokens.
    low = min(1000, vocab_size // 4)
    return Workload(name, [rng.integers(low, vocab_size, size=n, dtype=np.int64) for n in lengths])


def _lengths(name: str, count: int, lo: int, hi: int, rng) -> np.ndarray:
    if name in LOGNORMAL:
        median, sigma = LOGNORMAL[name]
        drawn = np.rint(rng.lognormal(np.log(median), sigma, size=count)).astype(np.int64)
        return np.clip(drawn, lo, hi)
    return rng.integers(lo, hi + 1, size=count)


def make_texts(
    name: str, vocabulary: list[str], *, requests: int | None = None, seed: int = 0
) -> list[str]:
    """A text workload: sentences of whole words drawn from ``vocabulary``; with ``requests``,
    its first texts only (the same ones the whole workload starts with)."""
    count, lo, hi = TEXT_WORKLOADS[name]
    rng = np.random.default_rng(seed)
    words = np.asarray(vocabulary)
    lengths = _lengths(name, count, lo, hi, rng)[:requests]
    return [" ".join(words[rng.integers(0, len(words), size=n)]) for n in lengths]


def vocabulary_words(tokenizer_json: Path, limit: int = 20000) -> list[str]:
    """Whole words (letters only, 3+ characters) of a tokenizer's vocabulary."""
    vocab = json.loads(tokenizer_json.read_text(encoding="utf-8"))["model"]["vocab"]
    items = vocab.items() if isinstance(vocab, dict) else ((w, i) for i, (w, _) in enumerate(vocab))
    words = sorted((i, w) for w, i in items if w.isascii() and w.isalpha() and len(w) >= 3)
    return [w for _, w in words[:limit]]


@dataclass
class RunResult:
    """One timed run of a system on a workload: wall seconds, tokens per second, peak device
    memory, and what else the system reports (``detail``: e.g. the peer's best batch size)."""

    seconds: float
    tokens_per_s: float
    peak_memory_gib: float
    detail: dict = field(default_factory=dict)


def flops(hf: dict, lengths: list[int], causal: bool, linear_per_token: float) -> float:
    """Model FLOPs of one forward over the given prompts: ``linear_per_token`` (2 x the
    parameters in the matmuls, ``deployment.flops_per_token``) per token, plus attention (QK^T
    and PV), halved for causal masks."""
    layers = _first(hf, "num_hidden_layers", "n_layers", "num_layers")
    heads = _first(hf, "num_attention_heads", "n_heads", "num_heads")
    hidden = _first(hf, "hidden_size", "dim", "d_model")
    head_dim = hf.get("head_dim") or hf.get("d_kv") or hidden // heads
    lengths_a = np.asarray(lengths, dtype=np.float64)
    linear = linear_per_token * lengths_a.sum()
    pairs = (lengths_a * (lengths_a + 1) / 2).sum() if causal else (lengths_a**2).sum()
    attention = 4.0 * pairs * heads * head_dim * layers
    return linear + attention


def _first(hf: dict, *keys: str) -> int:
    """The first of ``keys`` that the config has (families name the same size differently)."""
    for key in keys:
        if hf.get(key):
            return int(hf[key])
    raise KeyError(f"config.json has none of {', '.join(keys)}")


# Told of each pass as it ends: its number (from 1; for a peer, the batch size) and its seconds.
OnPass = Callable[[int, float], None]


def _ignore(_number: int, _seconds: float) -> None:
    """An ``OnPass`` that does nothing."""


def warm_up(
    run: Callable[[], object],
    max_passes: int = 6,
    settled: float = 0.1,
    on_pass: OnPass = _ignore,
) -> int:
    """Run passes until one takes within ``settled`` of the one before (compilation, CUDA
    graphs of every step size the run will see, allocator all done: the figure is then the
    steady state a server runs in). Step sizes depend on how fast inputs arrive, so a new
    graph bucket may first appear in a second or third pass. Returns the passes run."""
    before = None
    for passes in range(1, max_passes + 1):
        start = time.perf_counter()
        run()
        took = time.perf_counter() - start
        on_pass(passes, took)
        if before is not None and abs(took - before) <= settled * before:
            return passes
        before = took
    return max_passes


def median_run(
    run: Callable[[], RunResult], passes: int = 3, on_pass: OnPass = _ignore
) -> RunResult:
    """The pass of median time among ``passes`` (a single pass of a short workload is tens of
    milliseconds: one slow pass must not be the figure, nor one lucky pass)."""
    results = []
    for number in range(1, passes + 1):
        results.append(run())
        on_pass(number, results[-1].seconds)
    results.sort(key=lambda r: r.seconds)
    return results[len(results) // 2]


def engine_outputs(engine: Engine, inputs: list, pooling: str, **options) -> np.ndarray:
    """The engine's ``[n, dim]`` outputs for token-id or text inputs: normalised pooled vectors,
    or a sequence classifier's raw scores (``pooling`` ``RAW_SCORES``); ``options`` as for
    ``Engine.submit``."""
    if pooling == RAW_SCORES:
        return engine.submit_classify(inputs, use_activation=False, **options).result()
    return engine.submit(inputs, pooling=pooling, normalize=True, **options).result()


def run_engine(engine: Engine, workload: Workload, pooling: str) -> RunResult:
    """Time one pass of the workload through an already warm engine."""
    _reset_peak()
    start = time.perf_counter()
    engine_outputs(engine, workload.token_ids, pooling)
    seconds = time.perf_counter() - start
    return RunResult(seconds, workload.num_tokens / seconds, _peak_gib())


def run_engine_text(engine: Engine, texts: list[str], pooling: str) -> RunResult:
    """Texts in, tokenization included. The rate counts the tokens the texts became (decoded
    random ids do not re-tokenize to the same count; both sides cut at the model's limit)."""
    before = engine.stats.prompt_tokens_finished
    start = time.perf_counter()
    vectors = engine_outputs(engine, texts, pooling, truncate_prompt_tokens=-1)
    seconds = time.perf_counter() - start
    tokens = engine.stats.prompt_tokens_finished - before
    return RunResult(seconds, tokens / seconds, _peak_gib(), {"tokens": tokens, "vectors": vectors})


def run_sentence_transformers(
    model_dir: str,
    texts: list[str],
    *,
    dtype: torch.dtype,
    device: str,
    batch_sizes: list[int],
    on_size: OnPass = _ignore,
) -> RunResult:
    """``SentenceTransformer.encode`` on the texts at its best batch size (each size timed over
    all texts after a warm-up on the first batch); detail["vectors"] are the best run's.
    ``on_size(batch_size, seconds)`` hears of each size as it is timed."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir, device=device)
    model.to(dtype)
    best: RunResult | None = None
    per_size: dict[int, float] = {}
    for b in batch_sizes:
        model.encode(texts[:b], batch_size=b)  # warm-up
        _sync()
        start = time.perf_counter()
        vectors = model.encode(texts, batch_size=b, convert_to_numpy=True)
        _sync()
        seconds = time.perf_counter() - start
        per_size[b] = round(len(texts) / seconds, 1)
        on_size(b, seconds)
        if best is None or seconds < best.seconds:
            best = RunResult(seconds, 0.0, _peak_gib(), {"batch_size": b, "vectors": vectors})
    assert best is not None, "no batch sizes to time"
    best.detail["texts_per_s_by_batch_size"] = per_size
    del model
    free_device_memory()
    return best


@dataclass(frozen=True)
class GpuBusy:
    """How long the GPU executed something during ``passes`` profiled ``run()``s back to back
    (the union of every kernel's and copy's interval, from torch.profiler's CUDA activity),
    and their wall."""

    busy_s: float
    profiled_wall_s: float
    passes: int

    @property
    def fraction(self) -> float:
        """Of the profiled runs' own wall. The profiler slows a host-bound run, most of all
        its first launches: W4 on the MiniLM shape, one pass profiled 0.65-0.74 of its wall,
        five passes 0.82-0.84 (one process, an H200)."""
        return self.busy_s / self.profiled_wall_s

    def fraction_of(self, wall_s: float) -> float:
        """Of ``wall_s``, the wall of one run timed without the profiler (the kernels
        themselves run on the device, unaffected by it)."""
        return self.busy_s / self.passes / wall_s


def gpu_busy(run, passes: int = 1) -> GpuBusy | None:
    """The GPU's busy time during ``passes`` runs of ``run()``; None without CUDA."""
    if not torch.cuda.is_available():
        return None

    def runs() -> None:
        for _ in range(passes):
            run()

    events, wall_us = cuda_activity(runs)
    return GpuBusy(busy_us(events) / 1e6, wall_us / 1e6, passes)


def cuda_activity(run: Callable[[], object]) -> tuple[list, float]:
    """Every CUDA kernel and copy that torch.profiler records while ``run()`` runs, and the
    wall time of that run in microseconds (the device synchronized before and after)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return events, wall_us


def busy_us(events: list) -> float:
    """Microseconds covered by the union of the events' intervals."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted((e.time_range.start, e.time_range.end) for e in events):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


class Peer:
    """transformers AutoModel with SDPA on padded, length-sorted batches (descending, like
    sentence-transformers), pooling on the device, one host copy at the end. With pooling
    ``RAW_SCORES`` the model is its ``AutoModelForSequenceClassification`` and gives its
    logits (it pools as its class does)."""

    def __init__(self, model_dir: str, dtype: torch.dtype, device: str, pooling: str) -> None:
        from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

        self.device = torch.device(device)
        auto = AutoModelForSequenceClassification if pooling == RAW_SCORES else AutoModel
        try:
            self.model = auto.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
        except ValueError:  # no SDPA path in transformers (MPNet): its own attention
            self.model = auto.from_pretrained(model_dir, dtype=dtype)
        self.model.to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    @torch.inference_mode()
    def encode_ids(self, token_ids: list[np.ndarray], pooling: str, batch_size: int) -> np.ndarray:
        order = np.argsort([-len(t) for t in token_ids], kind="stable")
        outputs = []
        # The pad id the tokenizer pads with: a sequence classifier finds each row's last
        # token by it.
        pad = self.model.config.pad_token_id or 0
        for start in range(0, len(order), batch_size):
            batch = [token_ids[i] for i in order[start : start + batch_size]]
            width = max(len(t) for t in batch)
            ids = np.full((len(batch), width), pad, dtype=np.int64)
            mask = np.zeros((len(batch), width), dtype=np.int64)
            for row, t in enumerate(batch):
                ids[row, : len(t)] = t
                mask[row, : len(t)] = 1
            outputs.append(self._forward(torch.from_numpy(ids), torch.from_numpy(mask), pooling))
        pooled = torch.cat(outputs).float().cpu().numpy()
        result = np.empty_like(pooled)
        result[order] = pooled
        return result

    @torch.inference_mode()
    def encode_texts(
        self, texts: list[str], pooling: str, batch_size: int, max_len: int
    ) -> tuple[np.ndarray, int]:
        """Vectors and the number of (unpadded) tokens the texts became."""
        order = np.argsort([-len(t) for t in texts], kind="stable")
        outputs = []
        tokens = 0
        for start in range(0, len(order), batch_size):
            batch = [texts[i] for i in order[start : start + batch_size]]
            enc = self.tokenizer(
                batch, padding=True, truncation=True, max_length=max_len, return_tensors="pt"
            )
            tokens += int(enc["attention_mask"].sum())
            outputs.append(self._forward(enc["input_ids"], enc["attention_mask"], pooling))
        pooled = torch.cat(outputs).float().cpu().numpy()
        result = np.empty_like(pooled)
        result[order] = pooled
        return result, tokens

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
        ids = ids.to(self.device, non_blocking=True)
        mask = mask.to(self.device, non_blocking=True)
        if pooling == RAW_SCORES:
            return self.model(input_ids=ids, attention_mask=mask).logits.float()
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        if pooling == "last":
            last = mask.sum(1) - 1
            pooled = hidden[torch.arange(len(ids), device=self.device), last]
        elif pooling == "cls":
            pooled = hidden[:, 0]
        else:
            m = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1)
        return torch.nn.functional.normalize(pooled.float(), dim=-1)


def run_peer(
    peer: Peer,
    workload: Workload,
    pooling: str,
    batch_sizes: list[int],
    on_size: OnPass = _ignore,
) -> RunResult:
    """The peer at its best batch size (each size timed over the whole workload);
    ``on_size(batch_size, seconds)`` hears of each size as it is timed."""
    best: RunResult | None = None
    per_size: dict[int, int | str] = {}  # tokens/s, or "oom"
    for b in batch_sizes:
        peer.encode_ids(workload.token_ids[: min(b, len(workload.token_ids))], pooling, b)  # warm
        _reset_peak()
        _sync()
        start = time.perf_counter()
        try:
            peer.encode_ids(workload.token_ids, pooling, b)
        except torch.OutOfMemoryError:
            per_size[b] = "oom"
            continue
        _sync()
        seconds = time.perf_counter() - start
        per_size[b] = round(workload.num_tokens / seconds)
        on_size(b, seconds)
        if best is None or seconds < best.seconds:
            best = RunResult(seconds, workload.num_tokens / seconds, _peak_gib(), {"batch_size": b})
    if best is None:
        raise RuntimeError(f"the peer ran out of memory at every batch size {batch_sizes}")
    best.detail["tokens_per_s_by_batch_size"] = per_size
    return best


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return 0.0


def write_json(rows: list[dict], path: Path) -> None:
    path.write_text(json.dumps(rows, indent=2))
