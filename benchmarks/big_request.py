"""One client's large requests alone: issue 57's big load (2,048 texts of 130 words a request,
``fairness_hostile.text``, answered as float JSON), one request at a time against a real
``pipepool serve``, and where each request's time went by its ``Server-Timing`` (medians): the
``tokenize`` phase (the texts tokenised and the call's slices enqueued), ``engine``, ``replica``
and the rest. Each variant is a server of its own, one after the other:

    python benchmarks/big_request.py --model DIR --seconds 8 \\
        --variant "this||" --variant "pool|RAYON_NUM_THREADS=16|" \\
        --variant "main|PYTHONPATH=/path/to/main/src|--api-server-count 8"

A variant is ``NAME|ENV=V,...|SERVE FLAGS``: variables for the server's environment, flags
added to its command line.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import time

import httpx
from fairness_hostile import text
from multi_model import server_timing
from served import start_server

INPUTS = 2048  # the big load's texts a request
WORDS = 130  # words a text


def measure(url: str, body: bytes, warmup: float, seconds: float) -> tuple[list[float], list]:
    """Requests one after the other: ``warmup`` seconds unmeasured, then ``seconds`` measured;
    the measured ones' latencies (s) and ``Server-Timing`` phases (ms)."""
    headers = {"content-type": "application/json"}
    latencies: list[float] = []
    phases: list[dict[str, float]] = []
    with httpx.Client(base_url=url, timeout=300) as client:
        for measured, span in ((False, warmup), (True, seconds)):
            end = time.perf_counter() + span
            while time.perf_counter() < end:
                start = time.perf_counter()
                r = client.post("/v1/embeddings", content=body, headers=headers)
                r.raise_for_status()
                if measured:
                    latencies.append(time.perf_counter() - start)
                    phases.append(server_timing(r))
    return latencies, phases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model folder")
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds a variant")
    p.add_argument("--warmup", type=float, default=8.0, help="unmeasured seconds first")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--variant", action="append", required=True, help="NAME|ENV=V,...|FLAGS")
    args = p.parse_args()
    body = json.dumps({"input": [text(WORDS, i) for i in range(INPUTS)]}).encode()
    for variant in args.variant:
        name, envs, extra = variant.split("|")
        env = dict(e.split("=", 1) for e in envs.split(",") if e)
        flags = ["--log-level", "warning", "--no-access-log", "--model", args.model,
                 "--dtype", args.dtype, "--max-inputs-per-request", str(INPUTS),
                 "--max-tokens-per-request", "300000", *shlex.split(extra)]  # fmt: skip
        server, url = start_server(flags, env)
        try:
            latencies, phases = measure(url, body, args.warmup, args.seconds)
        finally:
            server.terminate()
            server.wait(60)
        keys = sorted({k for ph in phases for k in ph})
        medians = ", ".join(f"{k} {statistics.median(ph.get(k, 0.0) for ph in phases):.1f}"
                            for k in keys)  # fmt: skip
        print(f"{name}: {len(latencies)} answers in {args.seconds:g} s, median "
              f"{statistics.median(latencies) * 1000:.1f} ms; Server-Timing medians (ms): "
              f"{medians}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
