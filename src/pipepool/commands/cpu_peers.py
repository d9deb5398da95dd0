"""``pipepool bench --cpu-peers``: the engine on the CPU against the CPU runtimes users deploy,
in the same run, on the same texts and weights, tokenisation included for every system:

- ``st``: ``SentenceTransformer.encode`` (fp32; its vectors are the reference of the quality
  columns);
- ``ort``: ONNX Runtime fp32 on the model exported from the same checkpoint with
  ``torch.onnx.export`` (the transformer plus the folder's pooling, Dense and Normalize
  modules, run by sentence-transformers' own code while exporting), graph optimisation
  ``ORT_ENABLE_ALL``;
- ``ort-int8``: that export quantized by ``onnxruntime.quantization.quantize_dynamic``
  (QInt8 weights, per channel, the MatMul/Gemm weights: the linear layers).

Every system runs with the same intra-op thread count (``--threads``: ``torch.set_num_threads``
for the engine and sentence-transformers, ``intra_op_num_threads`` for ONNX Runtime). Each peer
runs at its best batch size of ``--peer-batch-sizes`` (timed on a sample of the texts); then
every round times each system once over all the texts, the order rotated a step each round so
that no system always runs right after the same one. The figure is the median of the rounds
(``--passes``). Each system's rate is also given in model GFLOP/s, beside the fp32 ceiling of
the workload on this machine (``cpu_ceiling``). The ONNX packages come with the ``bench-cpu``
extra.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..api.engine import Engine
from ..config import DTYPES
from .common import engine_config
from .cpu_ceiling import GEMM_ROWS, Ceiling, ceiling
from .workloads import make_texts, vocabulary_words, write_json

PEERS = ("st", "ort", "ort-int8")
# Peers pick their batch size on at most this many texts: the texts are independent random draws,
# so the first ones are as varied as all of them, and a peer's batch sizes cost that much less.
SAMPLE_TEXTS = 256
# The engine's pooling names -> sentence-transformers' Pooling modes (a folder without
# modules.json gets the engine's pooling, so both compute the same thing).
_ST_POOLING = {
    "mean": "mean",
    "cls": "cls",
    "last": "lasttoken",
    "max": "max",
    "mean_sqrt_len": "mean_sqrt_len_tokens",
    "weightedmean": "weightedmean",
}


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("CPU peers (--cpu-peers)")
    g.add_argument(
        "--cpu-peers",
        nargs="?",
        const=",".join(PEERS),
        type=_peers,
        metavar="PEERS",
        help="texts in on the CPU: the engine against sentence-transformers (st), ONNX Runtime "
        "fp32 (ort) and dynamic int8 (ort-int8) on the same model, tokenisation included, "
        "rounds alternated (--passes rounds; text workloads, default T5; needs "
        "pipepool[bench-cpu]); PEERS: a comma-separated subset (default: all)",
    )
    g.add_argument(
        "--threads",
        type=_positive,
        metavar="N",
        help="intra-op threads of every system (default: torch's, one per core)",
    )
    g.add_argument(
        "--engine-dtypes",
        type=_dtypes,
        metavar="LIST",
        help="one engine row per dtype, e.g. float32,bfloat16 (default: --dtype, else float32)",
    )


def _peers(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown CPU peer {(unknown or [text])[0]!r} (known: {', '.join(PEERS)})"
        )
    return names


def _dtypes(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",")]
    unknown = [n for n in names if n not in DTYPES or n == "auto"]
    if unknown:
        known = ", ".join(d for d in DTYPES if d != "auto")
        raise argparse.ArgumentTypeError(f"unknown dtype {unknown[0]!r} (known: {known})")
    return names


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


@dataclass
class System:
    """One contestant: texts in, one float32 vector per text out, tokenisation included."""

    name: str
    encode: Callable[[list[str]], np.ndarray]
    batch_size: int | None = None  # a peer's chosen size; the engine schedules its own steps
    by_batch_size: dict[int, float] = field(default_factory=dict)  # texts/s on the sample
    seconds: list[float] = field(default_factory=list)  # one per round
    vectors: np.ndarray | None = None  # of the last round


def run(args: argparse.Namespace) -> int:
    """Every text workload of ``args.workload`` (default T5): a table each, rows to --json."""
    _require_onnx(args.cpu_peers)
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    rows = []
    for name in args.workload or ["T5"]:
        rows.append(bench_workload(name, threads, args))
        print_table(rows[-1])
    if args.json:
        write_json(rows, args.json)
    return 0


def _require_onnx(peers: list[str]) -> None:
    """Fail before any model loads: the CLI names the extra of a missing module."""
    if any(p.startswith("ort") for p in peers):
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401  (torch.onnx.export's exporter)
    import sentence_transformers  # noqa: F401


def bench_workload(workload: str, threads: int, args: argparse.Namespace) -> dict:
    def say(message: str) -> None:
        print(f"bench {workload} cpu: {message}", file=sys.stderr, flush=True)

    base = engine_config(args).replace(device="cpu", cpu_threads=threads)
    dtypes = args.engine_dtypes or [base.dtype if base.dtype != "auto" else "float32"]
    with contextlib.ExitStack() as stack:
        engines = {}
        for dtype in dtypes:
            say(f"starting the engine ({dtype})")
            engine = stack.enter_context(Engine.from_config(base.replace(dtype=dtype)))
            engine.pipeline.wait_until_compiled(None)
            engines[dtype] = engine
        d = next(iter(engines.values())).pipeline.deployment
        words = vocabulary_words(d.folder.tokenizer_file)
        texts = make_texts(workload, words, requests=args.requests)
        st = reference_model(d.folder.path, d.pooling, d.max_model_len)
        tokenizer = text_tokenizer(d.folder.tokenizer_file, st)
        lengths = [sum(e.attention_mask) for e in tokenizer.encode_batch(texts)]  # no pads
        tokens = sum(lengths)
        say(f"{len(texts):,} texts, {tokens:,} tokens, {threads} threads")
        systems = [System(f"pipepool {dtype}", e.embed) for dtype, e in engines.items()]
        for system in systems:  # first calls: allocations, oneDNN's weight packing
            system.encode(texts[:SAMPLE_TEXTS])
        sample = texts[:SAMPLE_TEXTS]
        peers = _peer_encoders(args.cpu_peers, st, tokenizer, threads, stack, say)
        for name, encode in peers.items():
            systems.append(pick_batch_size(name, encode, sample, args.peer_batch_sizes, say))
        alternate(systems, texts, args.passes, say)
        say("timing this machine's fp32 GEMMs at the model's shapes (the ceiling)")
        bound = ceiling(d, lengths, threads)
        named = {s.name: s.vectors for s in systems}
        reference = named.get("sentence-transformers")
        if reference is None:  # not timed: its vectors are still the reference
            reference = st.encode(texts, batch_size=32, convert_to_numpy=True)
    row = make_row(d.folder.path.name, workload, texts, tokens, threads, systems, reference)
    return add_ceiling(row, bound)


def _peer_encoders(
    peers: list[str], st, tokenizer, threads: int, stack: contextlib.ExitStack, say
) -> dict[str, Callable[[list[str], int], np.ndarray]]:
    """name -> encode(texts, batch_size) of each peer asked for, ``st`` first."""
    encoders: dict[str, Callable[[list[str], int], np.ndarray]] = {}
    if "st" in peers:
        encoders["sentence-transformers"] = lambda texts, b: st.encode(
            texts, batch_size=b, convert_to_numpy=True
        )
    if any(p.startswith("ort") for p in peers):
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pipepool-onnx-")))
        say("exporting the model to ONNX (torch.onnx.export)")
        fp32 = export_onnx(st, folder / "fp32" / "model.onnx")
        if "ort" in peers:
            encoders["onnxruntime fp32"] = OrtPeer(fp32, tokenizer, threads).encode
        if "ort-int8" in peers:
            say("quantizing it (quantize_dynamic, QInt8 per channel)")
            int8 = quantize_int8(fp32, folder / "int8" / "model.onnx")
            encoders["onnxruntime int8"] = OrtPeer(int8, tokenizer, threads).encode
    return encoders


def reference_model(folder: Path, pooling: str, max_len: int):
    """The folder as sentence-transformers runs it, in fp32 on the CPU; a folder without
    modules.json as transformer + the engine's pooling + Normalize, cut at the engine's
    ``max_len`` (what the engine computes for it)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    if (folder / "modules.json").is_file():
        st = SentenceTransformer(str(folder), device="cpu")
    else:
        transformer = modules.Transformer(str(folder), max_seq_length=max_len)
        pool = modules.Pooling(
            transformer.get_embedding_dimension(), pooling_mode=_ST_POOLING[pooling]
        )
        st = SentenceTransformer(modules=[transformer, pool, modules.Normalize()], device="cpu")
    if st.tokenizer.pad_token is None:  # many decoders name none; the mask hides what pads
        st.tokenizer.pad_token = st.tokenizer.eos_token
    return st.to(torch.float32).eval()


def text_tokenizer(tokenizer_file: Path, st):
    """The model's tokenizer.json as the ONNX peers run it: cut where sentence-transformers
    cuts, padded to the longest text of each batch with sentence-transformers' pad token."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.enable_truncation(max_length=st.max_seq_length)
    hf = st.tokenizer
    pad_id = hf.pad_token_id if hf.pad_token_id is not None else 0
    tokenizer.enable_padding(pad_id=pad_id, pad_token=hf.pad_token or "")  # length None: longest
    return tokenizer


class _Embedder(torch.nn.Module):
    """sentence-transformers' modules as a function of the two tensors an ONNX graph takes."""

    def __init__(self, st) -> None:
        super().__init__()
        self.st = st

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        features = {"input_ids": input_ids, "attention_mask": attention_mask}
        return self.st(features)["sentence_embedding"]  # [batch, dim]


def export_onnx(st, path: Path) -> Path:
    """``torch.onnx.export`` (torch's dynamo exporter), batch and length dynamic."""
    path.parent.mkdir(parents=True)
    # The example pads its second row: an all-ones mask could let the attention mask be
    # traced away as "no padding".
    ids = torch.full((2, 8), 1000, dtype=torch.int64)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    batch, length = torch.export.Dim("batch"), torch.export.Dim("length")
    dims = {"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}}
    with contextlib.redirect_stdout(sys.stderr):
        torch.onnx.export(
            _Embedder(st).eval(),
            (ids, mask),
            str(path),
            input_names=["input_ids", "attention_mask"],
            output_names=["vectors"],
            dynamic_shapes=dims,
            dynamo=True,
            verbose=False,
        )
    return path


def quantize_int8(fp32: Path, path: Path) -> Path:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    path.parent.mkdir(parents=True)
    large = sum(f.stat().st_size for f in fp32.parent.iterdir()) > 1.8 * 2**30  # protobuf: 2 GiB
    quantize_dynamic(
        fp32,
        path,
        per_channel=True,
        weight_type=QuantType.QInt8,
        op_types_to_quantize=["MatMul", "Gemm"],
        use_external_data_format=large,
    )
    return path


class OrtPeer:
    """An ONNX Runtime session over an exported model, fed as sentence-transformers feeds its
    model: texts sorted longest first, tokenized a batch at a time, results in input order."""

    def __init__(self, path: Path, tokenizer, threads: int) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.tokenizer = tokenizer

    def encode(self, texts: list[str], batch_size: int) -> np.ndarray:
        order = np.argsort([-len(t) for t in texts], kind="stable")
        parts = []
        for start in range(0, len(order), batch_size):
            chosen = order[start : start + batch_size]
            batch = self.tokenizer.encode_batch([texts[i] for i in chosen])
            ids = np.array([e.ids for e in batch], dtype=np.int64)  # [batch, longest]
            mask = np.array([e.attention_mask for e in batch], dtype=np.int64)
            parts.append(self.session.run(None, {"input_ids": ids, "attention_mask": mask})[0])
        vectors = np.empty_like(np.concatenate(parts))
        vectors[order] = np.concatenate(parts)
        return vectors


def pick_batch_size(
    name: str, encode: Callable[[list[str], int], np.ndarray], sample: list[str], sizes, say
) -> System:
    """The peer at the batch size of ``sizes`` that encodes ``sample`` fastest."""
    by_size = {}
    for b in sizes:
        encode(sample[:b], b)  # warm-up: first-call allocations at this shape
        start = time.perf_counter()
        encode(sample, b)
        by_size[b] = len(sample) / (time.perf_counter() - start)
        say(f"{name} batch size {b}: {by_size[b]:,.1f} texts/s on {len(sample)} texts")
    best = max(by_size, key=lambda b: by_size[b])
    return System(
        name,
        lambda texts: encode(texts, best),
        batch_size=best,
        by_batch_size={b: round(r, 1) for b, r in by_size.items()},
    )


def alternate(systems: list[System], texts: list[str], rounds: int, say) -> None:
    """``rounds`` rounds, each timing every system once over ``texts``, round r starting at
    system r: a burst of load from elsewhere, or a system's after-effects (a thread pool still
    spinning), falls on each system alike over the rounds."""
    for r in range(rounds):
        for system in systems[r % len(systems) :] + systems[: r % len(systems)]:
            start = time.perf_counter()
            system.vectors = np.asarray(system.encode(texts), dtype=np.float32)
            system.seconds.append(time.perf_counter() - start)
            rate = len(texts) / system.seconds[-1]
            say(f"round {r + 1}: {system.name}: {rate:,.1f} texts/s")


def make_row(
    model: str,
    workload: str,
    texts: list[str],
    tokens: int,
    threads: int,
    systems: list[System],
    reference: np.ndarray,
) -> dict:
    """The workload's figures: texts/s (median of the rounds) per system, the first engine's
    rate over each system's, and the min and mean over the texts of each system's cosine
    against ``reference``, sentence-transformers' fp32 vectors of the same texts."""
    rates = {s.name: len(texts) / statistics.median(s.seconds) for s in systems}
    ours = rates[systems[0].name]
    rows = []
    for s in systems:
        cos = _cosines(s.vectors, reference)
        rows.append(
            {
                "system": s.name,
                "batch_size": s.batch_size,
                "texts_per_s": round(rates[s.name], 1),
                "texts_per_s_by_round": [round(len(texts) / x, 1) for x in s.seconds],
                "texts_per_s_by_batch_size": s.by_batch_size or None,
                "pipepool_ratio": round(ours / rates[s.name], 2),
                "min_cosine_vs_st_fp32": round(float(cos.min()), 6),
                "mean_cosine_vs_st_fp32": round(float(cos.mean()), 6),
            }
        )
    return {
        "model": model,
        "workload": workload,
        "texts": len(texts),
        "tokens": tokens,
        "threads": threads,
        "rounds": len(systems[0].seconds),
        "systems": rows,
    }


def add_ceiling(row: dict, bound: Ceiling) -> dict:
    """``row`` with each system's model GFLOP/s and the fp32 ceiling (``cpu_ceiling``)."""
    for s in row["systems"]:
        s["model_gflops"] = round(bound.gflops_of(s["texts_per_s"]), 1)
    row["fp32_ceiling"] = {
        "gemm_gflops": round(bound.gemm_flops_per_s / 1e9, 1),
        "gemm_how": bound.how,
        "gemm_rows": GEMM_ROWS,
        "model_flops": bound.model_flops,
        "linear_flops": bound.linear_flops,
        "texts_per_s": round(bound.texts_per_s, 1),
    }
    return row


def _cosines(a: np.ndarray | None, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def print_table(row: dict) -> None:
    print(
        f"{row['model']} {row['workload']}: {row['texts']:,} texts, {row['tokens']:,} tokens, "
        f"{row['threads']} threads, median of {row['rounds']} rounds"
    )
    heads = ("system", "batch", "texts/s", "pipepool/it", "min cos", "mean cos", "GFLOP/s")
    widths = (24, 6, 10, 12, 10, 10, 8)
    print(" ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True)))
    for s in row["systems"]:
        cells = (
            s["system"],
            s["batch_size"] or "-",
            s["texts_per_s"],
            s["pipepool_ratio"],
            f"{s['min_cosine_vs_st_fp32']:.6f}",
            f"{s['mean_cosine_vs_st_fp32']:.6f}",
            s.get("model_gflops", "-"),
        )
        print(" ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)))
    bound = row.get("fp32_ceiling")
    if bound:
        print(
            f"fp32 ceiling: {bound['texts_per_s']} texts/s: the linear layers' "
            f"{bound['linear_flops'] / 1e9:.1f} GFLOP (of the model's "
            f"{bound['model_flops'] / 1e9:.1f}) at this "
            f"machine's best fp32 GEMM, {bound['gemm_gflops']} GFLOP/s ({bound['gemm_how']}, "
            f"{bound['gemm_rows']} rows, the model's shapes)"
        )
    sys.stdout.flush()
