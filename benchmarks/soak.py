"""Soak a real ``pipepool serve`` on loopback: many requests of ever-new shapes at high
concurrency, optionally with stage processes killed under load and hand-made bad inputs, and
report memory (RSS of every process over time), errors, lost requests and recovery times.

    python benchmarks/soak.py --requests 20000 --concurrency 256 --pp 2
    python benchmarks/soak.py --model DIR --pp 2 --kill-at 3000,6000,9000 \
        --server-arg=--max-num-batched-tokens=64
    python benchmarks/soak.py --requests 2000 --bad-inputs

Bounded: it stops after ``--requests`` or ``--max-seconds``, whichever comes first, and only
talks to 127.0.0.1. Every request differs in batch size and text lengths (the allocator sees
tensors of new sizes all the time); a few fixed probe texts recur, and each answer to a probe
must match its first answer (cosine >= 0.99999), so a wrong vector under load or after a
restart is caught. Exit status 1 when a target is missed (any 5xx, connection error, lost
request, wrong probe, KV block left in use, or RSS growth over --max-growth between
--growth-from and the end).

RSS growth compares levels, not single samples: a process's RSS swings by a tenth or more
from one sample to the next (activations of the step in flight, the heap trimmed every 2 s),
so the level at request N is the median of the samples within --growth-window answers around
N, and the end level the median of the last --growth-window answers. The report also gives the
single-sample figure (the sample at --growth-from against the last one) and the least-squares
trend from --growth-from on, in percent per 10,000 answers. A sample every 100 answers puts 20
samples in a window: the bundled model's PP=1 levels then agreed within +-2.5% from run to run,
where 8 samples a window (every 250) let them land +-10% apart (docs/benchmarks/http-server.md,
issue 16).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
from served import free_port

# Vocabulary of the generated texts (lengths vary; words do not need to).
WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
    "wizards", "quietly", "hex", "every", "jolly", "frog", "near", "old", "river", "banks",
    "under", "grey", "autumn", "skies", "and", "pipeline", "stages", "compute", "embeddings",
    "for", "long", "documents", "split", "into", "chunks",
]  # fmt: skip
E = "/v1/embeddings"
TEN_MB = "word " * 2_000_000
# (what, route, JSON text): every one must be answered 4xx, never 5xx or a dropped connection.
# The surrogates are JSON escapes, as a client that sends UTF-16 halves writes them.
BAD_JSON = [
    ("lone surrogate", E, r'{"input": "a \ud800 b"}'),
    ("surrogate in a list", E, r'{"input": ["ok", "\udfff"]}'),
    ("surrogate, pooling", "/pooling", r'{"input": "\ud83d"}'),
    ("surrogate, tokenize", "/tokenize", r'{"prompt": "\ud800"}'),
    ("surrogate in model", E, r'{"input": "a", "model": "\ud800"}'),
    ("invalid json", E, '{"input": ['),
    ("empty body", E, ""),
    ("json null", E, "null"),
    ("input null", E, '{"input": null}'),
    ("huge token id", E, '{"input": [[1, 99999999999999999999]]}'),
    ("negative id", E, '{"input": [-5]}'),
    ("float ids", E, '{"input": [[1.5]]}'),
    ("nested", E, '{"input": [[[1]]]}'),
    ("empty string", E, '{"input": ""}'),
    ("dimensions -1", E, '{"input": "a", "dimensions": -1}'),
    ("dimensions huge", E, '{"input": "a", "dimensions": 1000000}'),
    ("truncate huge", E, '{"input": "a", "truncate_prompt_tokens": 99999999}'),
    ("unknown field", E, '{"input": "a", "foo": 1}'),
    ("NaN", E, '{"input": "a", "dimensions": NaN}'),
    ("null character", E, r'{"input": "a\u0000b"}'),
]
PROBES = ["a fixed probe sentence", "another probe, somewhat longer than the first one " * 3]


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(stat[1]) == pid:
                out.append(int(entry.name))
    return sorted(out)


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.statuses: Counter = Counter()
        self.errors: Counter = Counter()  # connection-level failures, by exception class
        self.sent = self.answered = 0
        self.probe_ref: dict[int, np.ndarray] = {}
        self.probe_min_cos = 1.0
        self.samples: list[dict] = []  # {"requests", "seconds", "rss": {name: MB}}
        self.recoveries: list[float] = []
        self.kill_failures = 0  # non-200 answers while a kill was being healed
        self.bad: list[dict] = []

    # -- the server ----------------------------------------------------------------------

    def start_server(self) -> None:
        a = self.args
        cmd = [sys.executable, "-m", "pipepool", "serve", "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--pp", str(a.pp), "--no-access-log"]
        cmd += ["--max-queued-requests", str(max(16384, a.concurrency * 16))]
        if a.model:
            cmd += ["--model", a.model]
        cmd += a.server_arg
        self.log = open(a.log, "w")  # noqa: SIM115 - lives as long as the server
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited with {self.proc.returncode}; see {a.log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise SystemExit("server not ready after 300 s")

    def stop_server(self) -> float:
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return time.monotonic() - started

    def sample(self, started: float) -> None:
        rss = {"server": rss_mb(self.proc.pid)}
        for k, pid in enumerate(children(self.proc.pid)):
            rss[f"stage{k + 1}"] = rss_mb(pid)
        self.samples.append(
            {"requests": self.answered, "seconds": round(time.monotonic() - started, 1), "rss": rss}
        )

    # -- requests ------------------------------------------------------------------------

    def text(self) -> str:
        n = max(1, int(self.rng.lognormvariate(np.log(self.args.mean_words), 0.9)))
        n = min(n, self.args.max_words)
        return " ".join(self.rng.choice(WORDS) for _ in range(n)) + f" {self.rng.random():.6f}"

    def make_request(self, i: int) -> tuple[str, dict, int | None]:
        """(path, body, probe index or None)."""
        if i % 50 == 7:
            p = (i // 50) % len(PROBES)
            return "/v1/embeddings", {"input": PROBES[p], "encoding_format": "float"}, p
        r = self.rng.random()
        if r < 0.05:
            return "/tokenize", {"prompt": self.text()}, None
        if r < 0.10:
            body = {"input": [self.text()], "task": "token_embed", "encoding_format": "base64"}
            return "/pooling", body, None
        batch = [self.text() for _ in range(self.rng.choice((1, 1, 1, 2, 2, 4, 8)))]
        body: dict = {"input": batch, "encoding_format": self.rng.choice(("float", "base64"))}
        if self.rng.random() < 0.2:
            body["truncate_prompt_tokens"] = -1
        return "/v1/embeddings", body, None

    async def one(self, http: httpx.AsyncClient, i: int) -> None:
        path, body, probe = self.make_request(i)
        self.sent += 1
        try:
            r = await http.post(self.url + path, json=body)
        except httpx.TransportError as exc:
            self.errors[type(exc).__name__] += 1
            return
        self.answered += 1
        self.statuses[r.status_code] += 1
        if r.status_code != 200:
            if self.healing():
                self.kill_failures += 1
            return
        if probe is not None:
            vec = np.asarray(r.json()["data"][0]["embedding"], dtype=np.float64)
            ref = self.probe_ref.setdefault(probe, vec)
            cos = float(vec @ ref / (np.linalg.norm(vec) * np.linalg.norm(ref)))
            self.probe_min_cos = min(self.probe_min_cos, cos)

    def healing(self) -> bool:
        return getattr(self, "_healing", False)

    async def killer(self) -> None:
        """SIGKILL a stage process at the request counts of --kill-at; time until /health
        says ok again."""
        targets = sorted(self.args.kill_at)
        async with httpx.AsyncClient(timeout=5) as http:
            for target in targets:
                while self.answered < target and self.answered + sum(self.errors.values()) < (
                    self.args.requests
                ):
                    await asyncio.sleep(0.05)
                stages = children(self.proc.pid)
                if not stages:
                    print("no stage process to kill (PP=1?)", file=sys.stderr)
                    return
                self._healing = True
                os.kill(stages[0], signal.SIGKILL)
                killed = time.monotonic()
                await asyncio.sleep(0.05)
                while True:
                    try:
                        r = await http.get(self.url + "/health")
                        # Healed: healthy, with a stage process that was not there before
                        # (right after the kill the server may still say ok: it has not
                        # noticed yet).
                        fresh = set(children(self.proc.pid)) - set(stages)
                        if r.status_code == 200 and fresh:
                            break
                    except httpx.TransportError:
                        pass
                    await asyncio.sleep(0.05)
                self.recoveries.append(round(time.monotonic() - killed, 2))
                self._healing = False
                print(f"  killed stage pid {stages[0]} at request {target}: healthy again "
                      f"after {self.recoveries[-1]} s", flush=True)  # fmt: skip

    async def drive(self) -> None:
        a = self.args
        started = time.monotonic()
        limits = httpx.Limits(
            max_connections=a.concurrency, max_keepalive_connections=a.concurrency
        )
        counter = iter(range(a.requests))
        next_sample = 0

        async def worker(http: httpx.AsyncClient) -> None:
            nonlocal next_sample
            for i in counter:
                if time.monotonic() - started > a.max_seconds:
                    return
                await self.one(http, i)
                if self.answered >= next_sample:
                    next_sample += a.sample_every
                    self.sample(started)
                    s = self.samples[-1]
                    if len(self.samples) > 1 and s["requests"] % 1000 >= a.sample_every:
                        continue  # every sample is kept; about one per 1,000 is printed
                    print(f"  {s['requests']:>7} answered  {s['seconds']:>7.1f} s  RSS MB "
                          + "  ".join(f"{k} {v:.0f}" for k, v in s["rss"].items() if v),
                          flush=True)  # fmt: skip

        # httpx's default keep-alive expiry (5 s) is shorter than the server's, as it should
        # be: a client that reuses a connection the server is closing sees a reset.
        async with httpx.AsyncClient(timeout=a.timeout, limits=limits) as http:
            tasks = [asyncio.create_task(worker(http)) for _ in range(a.concurrency)]
            if a.kill_at:
                tasks.append(asyncio.create_task(self.killer()))
            await asyncio.gather(*tasks)
        self.sample(started)
        self.seconds = time.monotonic() - started

    # -- bad inputs ----------------------------------------------------------------------

    def bad_inputs(self) -> None:
        """Hand-made bad requests: every one must get a 4xx (never a 5xx or a dropped
        connection), and a one-word request must be answered in < 2 s while two 10 MB bodies
        are being refused."""
        json_type = {"Content-Type": "application/json"}
        cases = [(name, path, body.encode(), json_type) for name, path, body in BAD_JSON]
        cases += [
            ("10 MB text", E, json.dumps({"input": TEN_MB}).encode(), json_type),
            ("10 MB tokenize", "/tokenize", json.dumps({"prompt": TEN_MB}).encode(), json_type),
            ("deep nesting", E, b"[" * 100_000 + b"]" * 100_000, json_type),
            ("text/plain json", E, b'{"input": "a"}', {"Content-Type": "text/plain"}),
            ("form encoded", E, b"input=a", {"Content-Type": "application/x-www-form-urlencoded"}),
        ]
        with httpx.Client(timeout=120) as http:
            for name, path, body, headers in cases:
                try:
                    r = http.post(self.url + path, content=body, headers=headers)
                    status = r.status_code
                except httpx.TransportError as exc:
                    status = type(exc).__name__
                self.bad.append({"case": name, "status": status})
                print(f"  bad input {name!r}: {status}", flush=True)
        huge = json.dumps({"input": TEN_MB}).encode()

        async def race() -> float:
            async with httpx.AsyncClient(timeout=120) as http:

                async def big():
                    return await http.post(
                        self.url + "/v1/embeddings", content=huge, headers=json_type
                    )

                bigs = [asyncio.create_task(big()) for _ in range(2)]
                await asyncio.sleep(0.05)  # the uploads are under way
                t0 = time.monotonic()
                r = await http.post(self.url + "/v1/embeddings", json={"input": "word"})
                waited = time.monotonic() - t0
                answers = await asyncio.gather(*bigs)
                for b in answers:
                    self.bad.append({"case": "10 MB while one word", "status": b.status_code})
                assert r.status_code == 200, r.text
                return waited

        self.one_word_s = asyncio.run(race())
        print(f"  one word answered in {self.one_word_s:.2f} s beside two 10 MB bodies")

    # -- report --------------------------------------------------------------------------

    def report(self) -> dict:
        a = self.args
        m = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                m[k] = float(v)
        growth, single, trend = rss_growth(self.samples, a.growth_from, a.growth_window)
        base = next((s for s in self.samples if s["requests"] >= a.growth_from), None)
        return {
            "args": {k: v for k, v in vars(a).items() if k != "log"},
            "seconds": round(self.seconds, 1),
            "sent": self.sent,
            "answered": self.answered,
            "lost": self.sent - self.answered - sum(self.errors.values()),
            "statuses": dict(self.statuses),
            "connection_errors": dict(self.errors),
            "probe_min_cosine": self.probe_min_cos,
            "kv_blocks_free": m.get("pipepool_kv_blocks_free"),
            "kv_blocks_total": m.get("pipepool_kv_blocks_total"),
            "pending_inputs": m.get("pipepool_server_pending_inputs"),
            "pipeline_restarts": m.get("pipepool_pipeline_restarts_total"),
            "recoveries_s": self.recoveries,
            "failed_during_recovery": self.kill_failures,
            "rss_samples": self.samples,
            "rss_growth_pct": growth,
            "rss_growth_single_pct": single,
            "rss_trend_pct_per_10k": trend,
            "rss_growth_from": base["requests"] if base else None,
            "bad_inputs": self.bad,
            "one_word_s": getattr(self, "one_word_s", None),
        }


def rss_growth(samples: list[dict], start: int, window: int) -> tuple[dict, dict, dict]:
    """Per process: (level growth %, single-sample growth %, trend % per 10k answers) from
    answer ``start`` to the end; empty when the run did not get past ``start``."""
    after = [s for s in samples if s["requests"] >= start]
    if len(after) < 2 or after[-1]["requests"] <= start:
        return {}, {}, {}
    end = after[-1]["requests"]
    growth, single, trend = {}, {}, {}
    for name in after[-1]["rss"]:

        def level(lo: float, hi: float, name=name) -> float | None:
            values = [s["rss"].get(name) for s in samples if lo <= s["requests"] <= hi]
            values = [v for v in values if v]
            return float(np.median(values)) if values else None

        base = level(start - window / 2, start + window / 2)
        last = level(end - window, end)
        first, final = after[0]["rss"].get(name), after[-1]["rss"].get(name)
        if not (base and last and first and final):
            continue
        growth[name] = round(100 * (last / base - 1), 2)
        single[name] = round(100 * (final / first - 1), 2)
        points = [(s["requests"], s["rss"][name]) for s in after if s["rss"].get(name)]
        x, y = np.array(points, dtype=np.float64).T
        slope = np.polyfit(x, y, 1)[0] if len(set(x)) > 1 else 0.0
        trend[name] = round(float(100 * slope * 10_000 / base), 2)
    return growth, single, trend


def judge(report: dict, max_growth: float) -> list[str]:
    problems = []
    fives = {s: n for s, n in report["statuses"].items() if int(s) >= 500}
    if fives:
        problems.append(f"5xx answers: {fives}")
    if report["connection_errors"]:
        problems.append(f"connection errors: {report['connection_errors']}")
    if report["lost"]:
        problems.append(f"{report['lost']} requests lost")
    if report["probe_min_cosine"] < 0.99999:
        problems.append(f"a probe answered differently: cosine {report['probe_min_cosine']}")
    if report["kv_blocks_free"] != report["kv_blocks_total"]:
        problems.append(f"KV blocks free {report['kv_blocks_free']} of {report['kv_blocks_total']}")
    if report["failed_during_recovery"]:
        problems.append(f"{report['failed_during_recovery']} requests failed during a restart")
    for name, pct in report["rss_growth_pct"].items():
        if pct > max_growth:
            problems.append(f"{name} RSS grew {pct}% after request {report['rss_growth_from']}")
    bad5 = [
        b for b in report["bad_inputs"] if not (isinstance(b["status"], int) and b["status"] < 500)
    ]
    if bad5:
        problems.append(f"bad inputs answered badly: {bad5}")
    if report["one_word_s"] is not None and report["one_word_s"] >= 2:
        problems.append(f"one word took {report['one_word_s']:.2f} s beside two 10 MB bodies")
    return problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="model folder (default: the bundled all-MiniLM-L6-v2)")
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--max-seconds", type=float, default=3600)
    p.add_argument("--timeout", type=float, default=300, help="per request, seconds")
    p.add_argument("--mean-words", type=float, default=16)
    p.add_argument("--max-words", type=int, default=150)
    p.add_argument("--sample-every", type=int, default=100, help="RSS sample every N answers")
    p.add_argument("--growth-from", type=int, default=5000, help="RSS growth measured from here")
    p.add_argument("--growth-window", type=int, default=2000,
                   help="answers whose samples' median is the RSS level at a point")  # fmt: skip
    p.add_argument("--max-growth", type=float, default=5.0, help="percent allowed")
    p.add_argument("--kill-at", type=lambda s: [int(x) for x in s.split(",")], default=[],
                   help="SIGKILL a stage process at these answered-request counts")  # fmt: skip
    p.add_argument("--bad-inputs", action="store_true", help="hand-made bad inputs after the soak")
    p.add_argument("--server-arg", action="append", default=[], help="extra serve flag")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", default="soak-server.log")
    p.add_argument("--json", help="write the report here")
    args = p.parse_args()

    soak = Soak(args)
    print(f"starting pipepool serve (pp={args.pp}) on {soak.url}; log in {args.log}", flush=True)
    soak.start_server()
    try:
        asyncio.run(soak.drive())
        if args.bad_inputs:
            soak.bad_inputs()
        time.sleep(1.0)  # let aborted work settle before reading the KV gauges
        report = soak.report()
    finally:
        stop_s = soak.stop_server()
    report["stop_s"] = round(stop_s, 2)
    report["exit_code"] = soak.proc.returncode
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    problems = judge(report, args.max_growth)
    print(
        json.dumps({k: v for k, v in report.items() if k not in ("rss_samples", "args")}, indent=1)
    )
    for line in problems:
        print("MISSED:", line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
