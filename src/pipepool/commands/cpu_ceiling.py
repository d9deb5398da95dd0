"""How fast any fp32 system could embed a workload on this CPU: the model's FLOPs over the
fastest fp32 GEMM this machine runs at the model's own projection shapes.

Every fp32 system does at least the linear layers' math of each token: ``workloads.flops``
counts it (2 per weight per token, embeddings excluded) with attention's. Timing each of the
checkpoint's 2-D weights as a ``[rows, in] x [in, out]`` GEMM, both ways this machine offers
(oneDNN's packed linear, ``layers/cpu_linear.py``, and ``F.linear``: MKL), with all threads in
one GEMM and with one thread (a replica of ``--dp`` runs one), gives the best rate the machine
reaches on that work. Dividing the linear layers' FLOPs by it gives a ceiling on texts/s that
no fp32 system passes unless its GEMM beats both libraries: attention, norms, activations and
tokenisation are left out, so the true ceiling is lower.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..layers import cpu_linear
from ..loading.deployment import flops_per_token, linear_weight_shapes
from ..loading.weights import Checkpoint
from ..models import family_of
from .workloads import flops

# Rows of each timed GEMM: a step of the engine's CPU tile, far past the sizes where the
# libraries' per-call costs show.
GEMM_ROWS = 2048
_REPEATS = 10


@dataclass(frozen=True)
class Ceiling:
    """The workload's model FLOPs (all of it, and the linear layers' alone), the machine's best
    fp32 GEMM rate at the model's shapes, and the texts/s that rate allows."""

    model_flops: float
    linear_flops: float
    gemm_flops_per_s: float
    how: str  # which library and thread layout reached the rate
    texts: int

    @property
    def texts_per_s(self) -> float:
        return self.texts / (self.linear_flops / self.gemm_flops_per_s)

    def gflops_of(self, texts_per_s: float) -> float:
        """The model GFLOP/s of a system embedding the workload at ``texts_per_s``."""
        return self.model_flops * texts_per_s / self.texts / 1e9


def ceiling(deployment, lengths: list[int], threads: int) -> Ceiling:
    """The ceiling of ``deployment``'s model on prompts of ``lengths`` tokens, ``threads``
    CPU threads (the caller's thread count is restored)."""
    folder = deployment.folder
    family = family_of(folder.architecture)
    checkpoint = Checkpoint(folder.path, family)
    per_token = flops_per_token(family, checkpoint)
    linear = per_token * sum(lengths)
    total = flops(folder.hf_config, lengths, deployment.causal, per_token)
    shapes = [(int(out), int(in_)) for out, in_ in linear_weight_shapes(family, checkpoint)]
    rate, how = best_gemm_rate(shapes, threads)
    return Ceiling(float(total), float(linear), rate, how, len(lengths))


def best_gemm_rate(shapes: list[tuple[int, int]], threads: int) -> tuple[float, str]:
    """(FLOP/s, how): the fastest of each library, with ``threads`` threads in one GEMM and
    ``threads`` x one thread (processes of one thread each, in parallel), over all ``shapes``
    (each distinct shape timed once, weighted by how often it occurs)."""
    before = torch.get_num_threads()
    counts: dict[tuple[int, int], int] = {}
    for shape in shapes:
        counts[shape] = counts.get(shape, 0) + 1
    best = (0.0, "")
    try:
        layouts = [(threads, 1)] + ([(1, threads)] if threads > 1 else [])
        for n, scale in layouts:
            torch.set_num_threads(n)
            for library, make in _libraries().items():
                spent = sum(c * seconds(make(*s)) for s, c in counts.items())
                work = sum(c * 2.0 * GEMM_ROWS * s[0] * s[1] for s, c in counts.items())
                rate = scale * work / spent
                layout = f"{threads} x 1 thread" if scale > 1 else f"{n} thread" + "s" * (n > 1)
                best = max(best, (rate, f"{library}, {layout}"))
    finally:
        torch.set_num_threads(before)
    return best


def _libraries() -> dict[str, Callable[[int, int], Callable[[], object]]]:
    out: dict[str, Callable[[int, int], Callable[[], object]]] = {"F.linear (MKL)": _plain}
    if cpu_linear.packs(torch.float32):
        out["oneDNN packed"] = _packed
    return out


def _plain(out_features: int, in_features: int) -> Callable[[], object]:
    x, w, b = _operands(out_features, in_features)
    return lambda: F.linear(x, w, b)


def _packed(out_features: int, in_features: int) -> Callable[[], object]:
    x, w, b = _operands(out_features, in_features)
    packed = cpu_linear.pack(w)
    return lambda: cpu_linear.linear(x, packed, b)


def _operands(out_features: int, in_features: int):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(GEMM_ROWS, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    return x, w, torch.zeros(out_features)


def seconds(fn: Callable[[], object], repeats: int = _REPEATS) -> float:
    """Mean wall seconds of one ``fn()`` over ``repeats`` calls, after two warm-up calls."""
    with torch.inference_mode():
        for _ in range(2):
            fn()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats
