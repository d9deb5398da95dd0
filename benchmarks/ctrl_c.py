"""How long Ctrl-C takes to stop a busy PP=2 pipeline, over many runs, optionally beside a CPU
hog (issue 16 item 7: 20 of 20 runs clean with a hog; < 2 s with ``--pp 2``).

    python benchmarks/ctrl_c.py --model DIR --runs 20 --hog 2

Each run starts one of three programs in its own process group, waits until its pipeline is
computing, and sends SIGINT to the whole group, as a terminal's Ctrl-C does (the stage
processes get it too):
- ``api``: a script that calls ``Engine.embed`` in a loop (PP=2, 8-token steps);
- ``embed``: ``pipepool embed --pp 2`` on a file of long lines;
- ``serve``: ``pipepool serve --pp 2`` with requests in flight from four client threads (it
  lets them finish first, up to ``--shutdown-timeout``: the figure includes that drain);
- ``serve-idle``: the same server, ready, with nothing in flight.
A run is clean when every process of the group has exited within ``--timeout`` seconds (the
figure is the time until the last one is gone; for ``api`` also the time until the engine was
closed, the rest being the interpreter's own exit) and the exit code is the one the program
promises for Ctrl-C (130 for the CLI; the script dies of its KeyboardInterrupt, which Python
reports as killed by SIGINT: -2). ``--hog N`` keeps N
processes spinning at full speed during every run. Prints each run and a summary per program;
exit status 1 when any run is not clean or slower than ``--max-seconds``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from served import free_port

_API_SCRIPT = """
import sys, time
import pipepool
engine = pipepool.Engine(sys.argv[1], pipeline_parallel_size=2, max_num_batched_tokens=8)
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


def _spin() -> None:
    while True:
        pass


def _group_pids(pgid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append(int(entry))
    return found


def _start(program: str, model: str, workdir: Path) -> tuple[subprocess.Popen, threading.Event]:
    """Start ``program``; return it and an event set once its pipeline is computing."""
    busy = threading.Event()
    # SIGINT back to its default in the child: started from a background job it would inherit
    # "ignored", and Python would then install no handler (a terminal's program has one).
    common = dict(
        start_new_session=True,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    if program == "api":
        script = workdir / "busy.py"
        script.write_text(_API_SCRIPT)
        cmd = [sys.executable, str(script), model]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, **common)

        def watch() -> None:
            for line in proc.stdout:
                if line.strip() == "busy":
                    busy.set()
                elif line.startswith("closed"):
                    busy.closed_at = float(line.split()[1])  # CLOCK_MONOTONIC: system-wide

        threading.Thread(target=watch, daemon=True).start()
        return proc, busy
    pp = ["--model", model, "--pp", "2", "--max-num-batched-tokens", "8"]
    if program == "embed":
        lines = workdir / "long.txt"
        lines.write_text(
            "".join(f"line {i} {'keep the pipeline busy ' * 20}\n" for i in range(2000))
        )
        cmd = [sys.executable, "-m", "pipepool", "embed", *pp, "--input", str(lines)]
        cmd += ["--output", str(workdir / "out.jsonl")]
        common["stderr"] = subprocess.PIPE
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, **common)

        def watch() -> None:  # busy once the progress bar counts a finished input
            seen = ""
            while chunk := proc.stderr.read(64):
                seen = (seen + chunk)[-256:]
                if " 1/" in seen:
                    busy.set()

        threading.Thread(target=watch, daemon=True).start()
        return proc, busy
    port = free_port()
    cmd = [sys.executable, "-m", "pipepool", "serve", *pp, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, **common)
    idle = program == "serve-idle"

    def client() -> None:
        url = f"http://127.0.0.1:{port}"
        body = json.dumps({"input": ["keep the pipeline busy " * 20] * 4}).encode()
        while proc.poll() is None:
            request = urllib.request.Request(
                url + "/v1/embeddings", body, {"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(url + "/health" if idle else request, timeout=60) as r:
                    r.read()
                busy.set()
                if idle:
                    return
            except OSError:
                time.sleep(0.05)

    for _ in range(4):  # requests in flight when the signal comes
        threading.Thread(target=client, daemon=True).start()
    return proc, busy


def one_run(program: str, model: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        proc, busy = _start(program, model, Path(tmp))
        pgid = proc.pid
        try:
            if not busy.wait(300):
                return {"clean": False, "why": "never became busy", "code": proc.poll()}
            time.sleep(0.3)  # steps in flight, not just finished
            os.killpg(pgid, signal.SIGINT)
            sent = time.monotonic()
            while time.monotonic() - sent < timeout:
                if proc.poll() is not None and not _group_pids(pgid):
                    seconds = time.monotonic() - sent
                    expected = -signal.SIGINT if program == "api" else 130
                    ok = proc.returncode == expected
                    run = {"clean": ok, "seconds": round(seconds, 3), "code": proc.returncode}
                    time.sleep(0.05)  # the reader thread takes the last line
                    if getattr(busy, "closed_at", None) is not None:
                        run["engine_closed_s"] = round(busy.closed_at - sent, 3)
                    return run
                time.sleep(0.01)
            left = _group_pids(pgid)
            return {"clean": False, "why": f"{len(left)} processes left after {timeout} s"}
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a decoder with at least 2 layers")
    parser.add_argument("--programs", default="api,embed,serve-idle,serve")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--hog", type=int, default=0, help="spinning processes beside each run")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--max-seconds", type=float, default=2.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    hogs = [mp.Process(target=_spin, daemon=True) for _ in range(args.hog)]
    for h in hogs:
        h.start()
    report = {}
    try:
        for program in args.programs.split(","):
            runs = []
            for k in range(args.runs):
                run = one_run(program, args.model, args.timeout)
                runs.append(run)
                print(f"[{program} {k + 1}/{args.runs}] {run}", flush=True)
            times = [r["seconds"] for r in runs if "seconds" in r]
            closed = [r["engine_closed_s"] for r in runs if "engine_closed_s" in r]
            report[program] = {
                "runs": len(runs),
                "engine_closed_max_s": max(closed) if closed else None,
                "clean": sum(r["clean"] for r in runs),
                "median_s": statistics.median(times) if times else None,
                "max_s": max(times) if times else None,
                "failures": [r for r in runs if not r["clean"]],
            }
    finally:
        for h in hogs:
            h.kill()
    print(json.dumps({"hog": args.hog, **report}, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"hog": args.hog, **report}, indent=1))
    bad = any(
        r["clean"] < r["runs"] or (r["max_s"] or 0) >= args.max_seconds for r in report.values()
    )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
