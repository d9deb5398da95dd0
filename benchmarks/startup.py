"""Start-up time: ``import pipepool``, ``Engine()`` until ready, the first ``embed``, and (where
the engine compiles in the background) ``Engine()`` until the compiled layer bodies are in use
(``compiled_s``), each in a fresh process, cold (empty compile caches) then warm (the caches the
cold run left).

    python benchmarks/startup.py [--model DIR] [--profile] [-- ENGINE OPTIONS as key=value]

With ``--profile`` the warm run also prints where ``Engine()`` spends its time (cProfile,
cumulative). Prints one line per run and a JSON summary last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import pipepool
t1 = time.perf_counter()
options = json.loads(sys.argv[1])
profile = sys.argv[2] == "1"
if profile:
    import cProfile, pstats
    prof = cProfile.Profile()
    prof.enable()
engine = pipepool.Engine(**options)
t2 = time.perf_counter()
if profile:
    prof.disable()
engine.embed(["The quick brown fox", "jumps over the lazy dog", "a third text"])
t3 = time.perf_counter()
# compile left to the engine: it finishes while the engine serves
engine.pipeline.wait_until_compiled(None)
t4 = time.perf_counter()
engine.close()
print(json.dumps({"import_s": t1 - t0, "engine_s": t2 - t1, "first_embed_s": t3 - t2,
                  "compiled_s": t4 - t1, "device": engine.info.devices[0]}))
if profile:
    pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(30)
"""


def run_child(options: dict, env: dict, profile: bool) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(options), "1" if profile else "0"],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if profile:
        print(proc.stderr[-6000:], file=sys.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("options", nargs="*", help="engine options, key=value (JSON values)")
    args = parser.parse_args()
    options = {"model": args.model} if args.model else {}
    for item in args.options:
        key, value = item.split("=", 1)
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    rows = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ)
        # Cold: compile caches in a fresh directory; warm: the same directory again.
        env["PIPEPOOL_CACHE_DIR"] = cache
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
        env["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
        for name, profile in (("cold", False), ("warm", False), ("warm2", args.profile)):
            rows[name] = run_child(options, env, profile)
            print(name, {k: round(v, 2) if isinstance(v, float) else v
                         for k, v in rows[name].items()}, flush=True)  # fmt: skip
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
