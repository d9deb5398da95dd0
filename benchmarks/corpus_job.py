"""A corpus job interrupted twice and resumed, against the same job run straight through
(not run in CI; minutes on 2 CPU cores).

    python benchmarks/corpus_job.py [--rows 50000] [--shard-size 5000] [--model DIR]

Writes a .jsonl corpus of ``--rows`` short texts (one row in 10,007 without a text: error
rows) and runs ``pipepool embed --input CORPUS --output-dir DIR`` on it:
- straight through, into ``reference/``;
- into ``resumed/``: SIGINT once two shards are on disk, the same command again and SIGKILL
  once it has written a shard, then the same command to the end.
Checks that ``resumed/`` holds the reference's shards, ids and error rows exactly and its
vectors bit for bit or within float rounding (docs/design.md §3: a shard of more texts than one
intake slice is planned into steps as its slices arrive, so two uninterrupted runs differ by
rounding too; ``--baseline`` runs the job straight through a second time to show by how much),
that no shard was written twice (each shard's file keeps the inode and mtime it had when
first written, and the runs' logs name each shard once), and samples each process's RSS
(/proc/PID/status VmRSS, every 0.2 s) to show that it stays flat as rows stream through.
Prints the figures; exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipepool.jobs.corpus_shards import read_shard

_WORDS = [
    "the", "a", "river", "city", "model", "vector", "search", "engine", "night", "morning",
    "paper", "shard", "quiet", "bright", "runs", "finds", "keeps", "builds", "reads", "writes",
    "under", "over", "through", "beside", "green", "small", "large", "old", "new",
]  # fmt: skip
_SAMPLE_S = 0.2
MIN_COSINE = 0.99999  # docs/design.md §3: vectors never differ beyond float rounding


@dataclass
class Run:
    """One ``pipepool embed`` process: how it ended and what it used."""

    name: str
    code: int | None = None
    wall_s: float = 0.0
    rss_mib: list[tuple[float, float, int]] = field(default_factory=list)  # (t, MiB, shards)
    log: str = ""


def write_corpus(path: Path, rows: int) -> None:
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            row: dict = {"id": f"doc-{i:06d}"}
            if i % 10_007 != 5:
                row["text"] = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 24)))
            f.write(json.dumps(row) + "\n")


def _rss_mib(pid: int) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    return int(m.group(1)) / 1024 if m else None


def _shards(out: Path) -> list[Path]:
    return sorted(out.glob("part-*.parquet"))


def run_job(
    name: str,
    command: list[str],
    out: Path,
    stop: tuple[signal.Signals, int] | None = None,
) -> Run:
    """Run ``command`` sampling its RSS; with ``stop`` = (signal, n), send the signal once
    ``out`` holds n shards more than when it started."""
    run = Run(name)
    start_shards = len(_shards(out)) if out.exists() else 0
    started = time.monotonic()
    proc = subprocess.Popen(
        command,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stderr.read()), daemon=True)
    reader.start()
    sent = False
    while proc.poll() is None:
        shards = len(_shards(out)) if out.exists() else 0
        rss = _rss_mib(proc.pid)
        if rss is not None:
            run.rss_mib.append((time.monotonic() - started, rss, shards))
        if stop is not None and not sent and shards - start_shards >= stop[1]:
            proc.send_signal(stop[0])
            sent = True
        time.sleep(_SAMPLE_S if stop is None or sent else 0.01)
    reader.join()
    run.code = proc.returncode
    run.wall_s = time.monotonic() - started
    run.log = "".join(chunks)
    return run


def stats(paths: list[Path]) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in paths}


def rss_summary(run: Run) -> str:
    """RSS once the first shard is written against the rest of the run: flat means the peak
    after it is close to it, however many rows followed."""
    after = [(t, mib, n) for t, mib, n in run.rss_mib if n > run.rss_mib[0][2]]
    if not after:
        return f"{run.name}: too short to sample"
    first = after[0][1]
    peak = max(mib for _, mib, _ in after)
    last = after[-1][1]
    shards = after[-1][2] - after[0][2]
    at_shard: dict[int, float] = {}  # shards on disk -> the first RSS seen with that many
    for _, mib, n in after:
        at_shard.setdefault(n, mib)
    series = ", ".join(f"{mib:.0f}" for mib in at_shard.values())
    return (
        f"{run.name}: RSS after its first shard {first:.0f} MiB, peak after it {peak:.0f} MiB "
        f"(+{peak - first:.0f}), at the end {last:.0f} MiB, over {shards} more shard(s), "
        f"{len(run.rss_mib)} samples; as each shard lands (MiB): {series}"
    )


@dataclass
class Comparison:
    """Two output folders, shard by shard: ``problems`` lists what makes them different jobs
    (shards, ids, error rows, vectors below ``MIN_COSINE``); ``identical`` counts shards whose
    vectors are equal bit for bit, ``max_diff`` and ``min_cos`` measure the others."""

    problems: list[str]
    shards: int
    identical: int
    max_diff: float
    min_cos: float


def compare(reference: Path, other: Path) -> Comparison:
    a, b = _shards(reference), _shards(other)
    if [p.name for p in a] != [p.name for p in b]:
        return Comparison([f"shard lists differ: {len(a)} against {len(b)}"], 0, 0, 0, 0)
    problems = []
    identical, max_diff, min_cos = 0, 0.0, 1.0
    for path_a, path_b in zip(a, b, strict=True):
        ids_a, vec_a = read_shard(path_a)
        ids_b, vec_b = read_shard(path_b)
        if ids_a != ids_b or vec_a.shape != vec_b.shape:
            problems.append(f"{path_a.name}: other ids or shape")
            continue
        if np.array_equal(vec_a, vec_b):
            identical += 1
            continue
        cos = np.sum(vec_a * vec_b, 1) / (np.linalg.norm(vec_a, 1) * np.linalg.norm(vec_b, 1))
        max_diff = max(max_diff, float(np.abs(vec_a - vec_b).max()))
        min_cos = min(min_cos, float(cos.min()))
        if cos.min() < MIN_COSINE:
            problems.append(f"{path_a.name}: cosine {cos.min()} < {MIN_COSINE}")
    errors_a = {p.name: p.read_text() for p in reference.glob("errors-*.jsonl")}
    errors_b = {p.name: p.read_text() for p in other.glob("errors-*.jsonl")}
    if errors_a != errors_b:
        problems.append("the error rows differ")
    return Comparison(problems, len(a), identical, max_diff, min_cos)


def describe(c: Comparison) -> str:
    rest = c.shards - c.identical
    if c.problems:
        return f"DIFFERENT: {c.problems}"
    if not rest:
        return f"identical: all {c.shards} shards bit for bit"
    return (
        f"{c.identical} of {c.shards} shards bit for bit, the other {rest} to float rounding "
        f"(max |diff| {c.max_diff:.1e}, min cos {c.min_cos:.8f})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--shard-size", type=int, default=5_000)
    parser.add_argument("--model", help="model folder (default: the bundled all-MiniLM-L6-v2)")
    parser.add_argument("--workdir", type=Path, help="keep the files here (default: a temp dir)")
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="run the job straight through twice: how far two uninterrupted runs differ",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        corpus = work / "corpus.jsonl"
        write_corpus(corpus, args.rows)
        num_shards = -(-args.rows // args.shard_size)
        print(
            f"{args.rows:,} rows ({corpus.stat().st_size / 2**20:.1f} MiB), "
            f"{num_shards} shards of {args.shard_size:,}",
            flush=True,
        )

        def command(out: Path) -> list[str]:
            cmd = [sys.executable, "-m", "pipepool", "embed", "--input", str(corpus)]
            cmd += ["--output-dir", str(out), "--shard-size", str(args.shard_size)]
            return cmd + ["--no-progress"] + (["--model", args.model] if args.model else [])

        reference, resumed = work / "reference", work / "resumed"
        straight = run_job("straight", command(reference), reference)
        print(f"straight through: exit {straight.code}, {straight.wall_s:.1f} s", flush=True)
        first = run_job("sigint", command(resumed), resumed, stop=(signal.SIGINT, 2))
        after_int = stats(_shards(resumed))
        leftovers_int = [p.name for p in resumed.glob(".*.tmp")]
        print(
            f"SIGINT: exit {first.code} after {first.wall_s:.1f} s, {len(after_int)} shard(s) "
            f"on disk, partial files left: {leftovers_int or 'none'}",
            flush=True,
        )
        second = run_job("sigkill", command(resumed), resumed, stop=(signal.SIGKILL, 1))
        after_kill = stats(_shards(resumed))
        leftovers_kill = [p.name for p in resumed.glob(".*.tmp")]
        print(
            f"SIGKILL: exit {second.code} after {second.wall_s:.1f} s, {len(after_kill)} "
            f"shard(s) on disk, partial files left: {leftovers_kill or 'none'}",
            flush=True,
        )
        last = run_job("rerun", command(resumed), resumed)
        final = stats(_shards(resumed))
        print(f"rerun: exit {last.code}, {last.wall_s:.1f} s", flush=True)

        baseline = None
        if args.baseline:  # the engine's own run-to-run difference, for scale
            again = run_job("straight again", command(work / "again"), work / "again")
            baseline = compare(reference, work / "again")
            print(f"straight again: exit {again.code}, {again.wall_s:.1f} s", flush=True)
        comparison = compare(reference, resumed)
        rewritten = [n for n, s in after_kill.items() if final.get(n) != s]
        rewritten += [n for n, s in after_int.items() if after_kill.get(n) != s]
        logged = re.findall(r"^(part-\d+\.parquet): rows", first.log + second.log + last.log, re.M)
        twice = sorted({n for n in logged if logged.count(n) > 1})
        resumed_total = first.wall_s + second.wall_s + last.wall_s
        print(
            f"\nstraight {straight.wall_s:.1f} s ({args.rows / straight.wall_s:,.0f} rows/s); "
            f"interrupted twice + rerun {resumed_total:.1f} s in all "
            f"({resumed_total - straight.wall_s:+.1f} s: three model loads, the shard each "
            "interruption cut short)"
        )
        print(f"shards: {len(final)} (expected {num_shards}); written twice: {twice or 'none'}")
        print(f"finished shards rewritten (inode/mtime changed): {rewritten or 'none'}")
        print(f"resumed against straight: {describe(comparison)}")
        if baseline is not None:
            print(f"straight again against straight: {describe(baseline)}")
        for run in (straight, first, second, last):
            print(rss_summary(run))
        checks = [
            straight.code == 0,
            first.code == 130,
            second.code == -signal.SIGKILL,
            last.code == 0,
            len(final) == num_shards,
            not comparison.problems,
            not rewritten,
            not twice,
            not leftovers_int,
            not list(resumed.glob(".*.tmp")),
        ]
        if not all(checks):
            print(f"FAILED: {checks}", file=sys.stderr)
            for run in (straight, first, second, last):
                print(f"--- {run.name} (exit {run.code}):\n{run.log[-1500:]}", file=sys.stderr)
            return 1
        return 0


if __name__ == "__main__":
    sys.exit(main())
