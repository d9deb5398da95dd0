"""Issue 36: the fp32 ceiling ``pipepool bench --cpu-peers`` prints beside its systems: the
workload's linear-layer FLOPs over the best fp32 GEMM rate this machine reaches at the
model's own projection shapes (``commands/cpu_ceiling.py``)."""

from __future__ import annotations

from collections import Counter

import torch

import pipepool
from pipepool.commands.cpu_ceiling import best_gemm_rate, ceiling
from pipepool.loading.deployment import flops_per_token, linear_weight_shapes, plan_deployment
from pipepool.loading.weights import Checkpoint
from pipepool.models import family_of


def _minilm(minilm_path):
    config = pipepool.EngineConfig.from_options(model=str(minilm_path), device="cpu")
    return plan_deployment(config)


def test_the_model_s_matmuls_are_its_projections_and_nothing_else(minilm_path):
    """all-MiniLM-L6-v2: per layer q, k, v and the attention output (384 x 384), FFN in and out;
    no embedding table, no norm, no pooler (sentence-transformers does not use it)."""
    d = _minilm(minilm_path)
    family = family_of(d.folder.architecture)
    shapes = linear_weight_shapes(family, Checkpoint(d.folder.path, family))
    assert Counter(shapes) == {(384, 384): 6 * 4, (1536, 384): 6, (384, 1536): 6}


def test_the_ceiling_is_the_linear_flops_at_the_best_gemm_rate(minilm_path):
    d = _minilm(minilm_path)
    family = family_of(d.folder.architecture)
    per_token = flops_per_token(family, Checkpoint(d.folder.path, family))
    lengths = [7, 40, 128, 300]
    threads = torch.get_num_threads()
    bound = ceiling(d, lengths, threads=1)
    assert torch.get_num_threads() == threads  # restored
    assert bound.linear_flops == per_token * sum(lengths)
    assert bound.model_flops > bound.linear_flops  # attention's share on top
    assert bound.texts == len(lengths)
    seconds = bound.linear_flops / bound.gemm_flops_per_s
    assert abs(bound.texts_per_s - len(lengths) / seconds) <= 1e-9 * bound.texts_per_s
    # A system at the ceiling computes the whole model faster than the GEMM alone allows.
    assert bound.gflops_of(bound.texts_per_s) * 1e9 > bound.gemm_flops_per_s
    assert bound.how.endswith(", 1 thread")


def test_the_best_rate_names_the_library_and_layout_that_reached_it():
    rate, how = best_gemm_rate([(64, 32), (32, 64), (64, 32)], threads=2)
    assert rate > 0
    library, layout = how.split(", ")
    assert library in {"F.linear (MKL)", "oneDNN packed"}
    assert layout in {"2 threads", "2 x 1 thread"}
