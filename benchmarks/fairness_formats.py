"""Which of a large client's work slows the light clients: issue 57's big load (2,048 texts a
request, ``fairness_hostile.py``) sent four ways to one ``pipepool serve``, one after the other:
as texts or as token ids (the front end tokenises the first), answered as float JSON or base64
(the front end serialises 2,048 x D floats for the first).

    python benchmarks/fairness_formats.py --model DIR [--rounds 2] [--formats ids-b64,text-float]

After ``--warmup`` seconds of all of fairness_hostile's loads at once (unmeasured: a GPU
server compiles meanwhile), the light clients alone (quiet, ``--quiet-seconds``), then beside
each format for ``--seconds``, ``--rounds`` times; per format the light clients' p50, p99 and
its ratio to quiet, the tokens a second embedded, the big client's answers, and where the
slowest light answers spent their time by ``Server-Timing``
(``fairness_hostile.tail_breakdown``: over replica processes, the replica's part of ``engine``
too). Token ids need the server's ``--allow-token-ids``, which
this script passes.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import numpy as np
from fairness_hostile import Hostile, hostiles, measure, p99_ms, text
from served import start_server
from tokenizers import Tokenizer

FORMATS = ("text-float", "text-b64", "ids-float", "ids-b64")


def bodies(model: Path, inputs: int, words: int) -> dict[str, dict]:
    """The big request in each format: the same texts, or their token ids by the model's own
    tokenizer (special tokens included, as the server would make them)."""
    texts = [text(words, i) for i in range(inputs)]
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    ids = [encoding.ids for encoding in tokenizer.encode_batch(texts)]
    return {
        "text-float": {"input": texts},
        "text-b64": {"input": texts, "encoding_format": "base64"},
        "ids-float": {"input": ids},
        "ids-b64": {"input": ids, "encoding_format": "base64"},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="model folder (tokenizer.json)")
    p.add_argument("--inputs", type=int, default=2048, help="texts a big request")
    p.add_argument("--words", type=int, default=130, help="words a big text")
    p.add_argument("--seconds", type=float, default=10.0, help="light seconds a format")
    p.add_argument("--quiet-seconds", type=float, default=12.0, help="light seconds alone")
    p.add_argument("--warmup", type=float, default=15.0)
    p.add_argument("--rounds", type=int, default=2, help="times each format is measured")
    p.add_argument(
        "--formats", default=",".join(FORMATS), help="comma-separated, of " + ", ".join(FORMATS)
    )
    p.add_argument("--server-arg", action="append", default=[], help="more serve flags")
    args = p.parse_args()
    names = args.formats.split(",")
    unknown = sorted(set(names) - set(FORMATS))
    if unknown:
        p.error(f"unknown --formats {unknown}; choose from {', '.join(FORMATS)}")
    formats = bodies(args.model, args.inputs, args.words)
    flags = ["--log-level", "warning", "--no-access-log", "--model", str(args.model),
             "--max-inputs-per-request", str(args.inputs), "--max-tokens-per-request", "300000",
             "--allow-token-ids", *args.server_arg]  # fmt: skip
    server, url = start_server(flags)
    try:
        if args.warmup > 0:
            load = hostiles("all", args.inputs, args.words, 28_000)
            asyncio.run(measure(url, args.warmup, load))
        quiet, _, _, tail = asyncio.run(measure(url, args.quiet_seconds, []))
        q99 = p99_ms(quiet)
        print(f"quiet: p50 {np.median(quiet) * 1000:.1f} ms, p99 {q99:.1f} ms; {tail}", flush=True)
        for _ in range(args.rounds):
            for name in names:
                big = Hostile("big", "/v1/embeddings", formats[name], "127.0.2.1")
                light, _, rate, tail = asyncio.run(measure(url, args.seconds, [big]))
                l99 = p99_ms(light)
                print(
                    f"{name}: p50 {np.median(light) * 1000:.1f} ms, p99 {l99:.1f} ms "
                    f"({l99 / q99:.1f}x quiet); {rate:,.0f} tok/s embedded; big "
                    f"{dict(big.statuses)}; {tail}",
                    flush=True,
                )
    finally:
        server.terminate()
        server.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
