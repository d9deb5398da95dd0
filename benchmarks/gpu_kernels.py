"""Where a workload's device time goes, kernel by kernel, for the engine and for the peer.

    python3 benchmarks/gpu_kernels.py minilm W1 2048     # KEY WORKLOAD [PEER_BATCH_SIZE]

KEY is a checkpoint of ``gpu_suite.py`` (built there with random weights from the real config);
the engine runs with default settings (bf16), three warm-up passes, four timed passes (steps per
pass, wall and device-busy milliseconds per step), then one pass under torch.profiler: every
CUDA kernel and copy summed by name and by category (attention, gemm, triton, copy, index,
other), the union of their intervals against the wall time, and the top kernels. With a peer
batch size, the peer (transformers, SDPA, padded length-sorted batches) gets the same table.
"""

from __future__ import annotations

import argparse
import collections
import time

import gpu_suite
import torch

import pipepool
from pipepool.commands.workloads import Peer, busy_us, cuda_activity, make_workload


def category(name: str) -> str:
    n = name.lower()
    if "flash" in n or "fmha" in n or "attention" in n or "sdpa" in n:
        return "attention"
    if "gemm" in n or "nvjet" in n or "cutlass" in n or "sm90" in n or "cublas" in n:
        return "gemm"
    if "memcpy" in n or "memset" in n:
        return "copy"
    if "triton" in n:
        return "triton"
    if "index" in n or "gather" in n or "scatter" in n:
        return "index"
    return "other"


def kernel_table(run, label: str, tokens: int, top: int = 22) -> None:
    events, wall_us = cuda_activity(run)
    wall_ms = wall_us / 1e3
    by_name: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    by_category: dict[str, float] = collections.defaultdict(float)
    for e in events:
        ms = (e.time_range.end - e.time_range.start) / 1e3
        by_name[e.name][0] += ms
        by_name[e.name][1] += 1
        by_category[category(e.name)] += ms
    busy_ms = busy_us(events) / 1e3
    total = sum(ms for ms, _ in by_name.values())
    print(f"== {label}: wall {wall_ms:.1f} ms, kernels {total:.1f} ms, union busy "
          f"{busy_ms:.1f} ms ({busy_ms / wall_ms:.3f}), "
          f"{tokens / wall_ms / 1e3:.3f}M tok/s")  # fmt: skip
    print("   by category: " + ", ".join(
        f"{c} {ms:.1f} ms ({ms / total:.0%})"
        for c, ms in sorted(by_category.items(), key=lambda x: -x[1])
    ))  # fmt: skip
    for name, (ms, n) in sorted(by_name.items(), key=lambda x: -x[1][0])[:top]:
        print(f"   {ms:8.2f} ms {ms / total:5.1%} x{n:5d} {ms / n * 1e3:8.1f}us  {name[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("key", help="a gpu_suite checkpoint: minilm, 0.6b, 8b")
    parser.add_argument("workload", help="W1 ... W4")
    parser.add_argument("peer_batch_size", type=int, nargs="?", default=0)
    args = parser.parse_args()
    path = gpu_suite.build_checkpoint(args.key)
    options = {"dtype": "bfloat16"}
    if args.key == "minilm":
        options["max_model_len"] = 512
    engine = pipepool.Engine(str(path), **options)
    engine.pipeline.wait_until_compiled(None)
    d = engine.pipeline.deployment
    vocab, max_len = d.vocab_size, d.max_model_len
    workload = make_workload(args.workload, vocab, max_len=max_len)
    pooling = engine.info.pooling

    def one_pass():
        engine.submit(workload.token_ids, pooling=pooling, normalize=True).result()

    for _ in range(3):
        one_pass()
    passes, steps0, busy0 = 4, engine.stats.steps, engine.pipeline.stage_busy_s()[0]
    start = time.perf_counter()
    for _ in range(passes):
        one_pass()
    seconds = time.perf_counter() - start
    steps = engine.stats.steps - steps0
    busy_ms = (engine.pipeline.stage_busy_s()[0] - busy0) / steps * 1e3
    print(f"{args.key} {args.workload}: {steps / passes:.1f} steps/pass, "
          f"{seconds / steps * 1e3:.2f} ms/step, busy {busy_ms:.2f} ms/step, "
          f"{workload.num_tokens * passes / seconds / 1e6:.3f}M tok/s")  # fmt: skip
    kernel_table(one_pass, f"engine {args.key} {args.workload}", workload.num_tokens)
    engine.close()
    torch.cuda.empty_cache()
    if args.peer_batch_size:
        peer = Peer(str(path), torch.bfloat16, "cuda")
        b = args.peer_batch_size
        peer.encode_ids(workload.token_ids, pooling, b)  # warm-up
        kernel_table(lambda: peer.encode_ids(workload.token_ids, pooling, b),
                     f"peer {args.key} {args.workload} B={b}", workload.num_tokens)  # fmt: skip


if __name__ == "__main__":
    main()
