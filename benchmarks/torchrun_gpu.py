"""Issue 11 on the two-GPU machine: the README's multi-host command, as two "hosts".

Runs ``pipepool embed --pp 2`` as two torchrun nodes on one machine (``--nnodes 2
--node-rank 0|1 --nproc-per-node 1``, one GPU each through CUDA_VISIBLE_DEVICES=0 and =1,
NCCL for hidden states, a rendezvous on 127.0.0.1), and PP=1 on one GPU, on the same
chunking prompts (docs/design.md §1's reproducer plus long prompts, a 64-token budget). Then it
judges both by the bf16 contract of docs/design.md §3 against transformers (fp32 reference,
transformers bf16 for the allowance) and compares PP=2 with PP=1. With ``--serve`` it also runs
the README's ``serve --pp 2`` the same way, posts the same texts to ``/v1/embeddings``, compares
the vectors with PP=1's, and stops the server with SIGTERM (every process must exit 0; the
server's dependencies must be importable). Prints one JSON object and the commands it ran; exit
code 0 when every check passes.

    python3 benchmarks/torchrun_gpu.py --model /tmp/pipepool-bench/0.6b-shape --out /tmp/res/tr
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from served import free_port


def _prompts(model: str, device: str):
    """(texts, their token ids, the deployment the reference is placed by)."""
    from pipepool.config import EngineConfig
    from pipepool.intake.inputs import InputPreparer
    from pipepool.loading.deployment import plan_deployment
    from pipepool.parity import REPRODUCER_PROMPTS

    d = plan_deployment(EngineConfig(model=model, device=device, max_model_len=1024))
    long = [" ".join(f"{w} {i}" for i in range(n)) for w, n in (("alpha", 60), ("beta", 120))]
    texts = [*REPRODUCER_PROMPTS, *long]
    return texts, InputPreparer(d).prepare(texts, long_inputs="truncate"), d


def _embed_args(model: str, inputs: Path, out: Path, budget: int, device: str) -> list[str]:
    return [
        "-m", "pipepool", "embed", "--model", model, "--device", device, "--no-normalize",
        "--max-num-batched-tokens", str(budget), "--max-num-seqs", "5",
        "--input", str(inputs), "--output", str(out),
    ]  # fmt: skip


def _start_two_hosts(pipepool_args: list[str], logs: Path, tag: str):
    """The README's multi-host command as two "hosts" on this machine, one GPU each."""
    port = str(free_port())
    procs, commands = [], []
    for node, gpu in ((0, "0"), (1, "1")):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
            str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
            port, *pipepool_args, "--pp", "2",
        ]  # fmt: skip
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
        commands.append(f"CUDA_VISIBLE_DEVICES={gpu} " + shlex.join(cmd))
        log = (logs / f"{tag}node{node}.log").open("w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs, commands


def _run_torchrun(model: str, inputs: Path, out: Path, budget: int, device: str, logs: Path):
    t0 = time.time()
    procs, commands = _start_two_hosts(_embed_args(model, inputs, out, budget, device), logs, "")
    codes = [p.wait(timeout=900) for p in procs]
    return {"commands": commands, "exit_codes": codes, "seconds": round(time.time() - t0, 1)}


def _serve_two_hosts(model: str, texts: list[str], budget: int, device: str, logs: Path):
    """``serve --pp 2`` as two hosts: wait for /health, embed ``texts``, SIGTERM rank 0."""
    import signal
    import urllib.error
    import urllib.request

    port = free_port()
    args = [
        "-m", "pipepool", "serve", "--model", model, "--device", device, "--port", str(port),
        "--max-num-batched-tokens", str(budget), "--max-num-seqs", "5",
    ]  # fmt: skip
    t0 = time.time()
    procs, commands = _start_two_hosts(args, logs, "serve-")
    report: dict = {"commands": commands}
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if any(p.poll() is not None for p in procs) or time.time() - t0 > 600:
                raise RuntimeError("the server did not come up")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)
        report["ready_seconds"] = round(time.time() - t0, 1)
        body = json.dumps({"input": texts}).encode()
        request = urllib.request.Request(
            f"{url}/v1/embeddings", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as reply:
            data = json.loads(reply.read())["data"]
        vectors = np.array([d["embedding"] for d in data], dtype=np.float32)
        os.kill(_rank0_pid(procs[0].pid), signal.SIGTERM)
        report["exit_codes"] = [p.wait(timeout=120) for p in procs]
    except BaseException:
        for p in procs:
            p.kill()
        raise
    report["seconds"] = round(time.time() - t0, 1)
    return vectors, report


def _rank0_pid(agent_pid: int) -> int:
    """The pipepool process torchrun started as rank 0 (a child of node 0's agent)."""
    children = Path(f"/proc/{agent_pid}/task/{agent_pid}/children").read_text().split()
    for child in children:
        if b"RANK=0" in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
            return int(child)
    raise RuntimeError(f"no rank 0 among torchrun's children {children}")


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, default=Path("/tmp/res/torchrun"))
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    parser.add_argument("--serve", action="store_true", help="also the README's serve command")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    texts, token_ids, deployment = _prompts(args.model, args.device)
    inputs = args.out / "prompts.jsonl"
    inputs.write_text("".join(json.dumps(ids.tolist()) + "\n" for ids in token_ids))

    pp1_out = args.out / "pp1.npy"
    pp1_cmd = [sys.executable, *_embed_args(args.model, inputs, pp1_out, args.budget, args.device)]
    pp1 = subprocess.run(pp1_cmd, env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    pp2_out = args.out / "pp2.npy"
    run = _run_torchrun(args.model, inputs, pp2_out, args.budget, args.device, args.out)
    report = {"pp1_command": "CUDA_VISIBLE_DEVICES=0 " + shlex.join(pp1_cmd), **run}
    report["pp1_exit_code"] = pp1.returncode
    if pp1.returncode or any(run["exit_codes"]):
        report["logs"] = {p.name: p.read_text()[-3000:] for p in args.out.glob("node*.log")}
        print(json.dumps(report, indent=2))
        return 1

    got = {"pp1": np.load(pp1_out), "pp2": np.load(args.out / "pp2.npy")}
    where = "cuda:0" if args.device == "cuda" else "cpu"
    ref32 = np.stack(_reference(deployment, texts, token_ids, "float32", where))
    ref16 = np.stack(_reference(deployment, texts, token_ids, "bfloat16", where))
    allowance = 1.5 * (1 - _cos(ref16, ref32)) + 1e-5  # docs/design.md §3, per request
    report["tokens"] = [len(t) for t in token_ids]
    report["transformers_bf16_vs_fp32_min_cos"] = float(_cos(ref16, ref32).min())
    ok = True
    for name, vectors in got.items():
        err = 1 - _cos(vectors, ref32)
        passed = bool((err <= allowance).all())
        ok &= passed
        report[name] = {"min_cos_vs_fp32": float(1 - err.max()), "bf16_contract": passed}
    # PP=2 equals PP=1 within the same allowance (in practice bit for bit: same step plans).
    pp2_vs_pp1 = _cos(got["pp2"], got["pp1"])
    report["pp2_vs_pp1_min_cos"] = float(pp2_vs_pp1.min())
    report["passed"] = ok and bool((1 - pp2_vs_pp1 <= allowance).all())
    if args.serve:
        served, serve = _serve_two_hosts(args.model, texts, args.budget, args.device, args.out)
        served_vs_pp1 = _cos(served, got["pp1"])
        serve["served_vs_pp1_min_cos"] = float(served_vs_pp1.min())
        serve["passed"] = bool((1 - served_vs_pp1 <= allowance).all()) and not any(
            serve["exit_codes"]
        )
        report["serve"] = serve
        report["passed"] = report["passed"] and serve["passed"]
    print(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


def _reference(deployment, texts, token_ids, dtype: str, device: str) -> list[np.ndarray]:
    from pipepool.parity.reference import compute_reference

    ref = compute_reference(
        "transformers", deployment, texts, token_ids, ["last"], device=device, dtype=dtype
    )
    return ref.outputs["last"]


if __name__ == "__main__":
    raise SystemExit(main())
