"""Does the server accept exactly what its OpenAPI schema says, and answer only what it lists?
Schemathesis with every check against three ``pipepool serve``s, one model each, so that every
route reaches a model that does its task (issue 37 item 6): the bundled MiniLM (an embedder), a
tiny cross-encoder and a tiny Qwen3 classifier (``multi_model.py``'s):

    pip install schemathesis
    python benchmarks/schema_conformance.py [--max-examples 100] [--seed 2]

Prints the cases generated and the failures by check, each failing operation with its code,
and exits non-zero on any failure or any error of schemathesis' own. What the schema says in
words but JSON Schema cannot (two fields compared, tokens counted) is told to schemathesis by
the hooks of ``schema_hooks.py``. One worker by default: with two, schemathesis 4.32's coverage
phase failed now and then in its own generator ("Inconsistent results", a different route each
run). The server keeps its Batch API state, and schemathesis its caches, in a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from multi_model import cpu_models
from served import start_server


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-examples", type=int, default=100, help="cases per operation")
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--workers", type=int, default=1)
    args = p.parse_args()
    if shutil.which("schemathesis") is None:
        raise SystemExit("schemathesis is not installed: pip install schemathesis")
    bad = 0
    for model in cpu_models():
        print(f"\n== {model.name} ({model.task})", flush=True)
        bad += check(model.path, args)
    return 1 if bad else 0


def check(model: Path, args: argparse.Namespace) -> int:
    """Schemathesis against a server of ``model``; prints its summary, returns its failures
    and errors."""
    work = Path(tempfile.mkdtemp(prefix="pipepool-schema-"))
    flags = ["--model", str(model), "--device", "cpu", "--state-dir", str(work / "state")]
    proc, url = start_server([*flags, "--no-access-log"])
    try:
        subprocess.run(
            ["schemathesis", "run", f"{url}/openapi.json", "--checks", "all",
             "--max-examples", str(args.max_examples), "--seed", str(args.seed),
             "--workers", str(args.workers), "--continue-on-failure",
             "--report", "json", "--report-dir", str(work / "report")],
            check=False,
            cwd=work,  # its caches (.hypothesis, .schemathesis) go there, not in the checkout
            env=hooks_env(),
        )  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(60)
    (report_path,) = (work / "report").glob("*.json")
    report = json.loads(report_path.read_text())
    shutil.rmtree(work, ignore_errors=True)
    cases = report["test_cases"]
    print(f"\n{cases['generated']} cases, {cases['with_failures']} with failures")
    for failure in report["failures"]:
        print(f"{failure['code']} {failure['title']}: {failure['count']}")
        for operation in failure["operations"]:
            print(f"  {operation}")
    for error in report["errors"]:
        print(f"error (schemathesis' own): {error['title']}: {error['count']}")
    return len(report["failures"]) + len(report["errors"])


def hooks_env() -> dict[str, str]:
    """This environment, with schema_hooks.py (next to this file) as schemathesis' hooks."""
    here = str(Path(__file__).resolve().parent)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "SCHEMATHESIS_HOOKS": "schema_hooks", "PYTHONPATH": path}


if __name__ == "__main__":
    sys.exit(main())
