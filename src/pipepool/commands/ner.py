"""``pipepool ner``: named entities of texts (arguments, a file or stdin) from a token
classifier; prints them, or writes one JSON line per text."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..api.token_classification import AGGREGATIONS
from ..errors import InvalidInputError
from .common import add_engine_args, engine_config
from .embed import read_inputs


def add_parser(sub, help: str) -> None:
    p = sub.add_parser("ner", help=help, description=help)
    p.add_argument("texts", nargs="*", metavar="TEXT", help="texts ('-': read stdin)")
    p.add_argument(
        "--input",
        help=".txt (one text per line), .jsonl (strings or objects with 'text'), .json (an "
        "array of those), or '-' for stdin",
    )
    p.add_argument(
        "--aggregation-strategy",
        choices=AGGREGATIONS,
        default="simple",
        help="as transformers' token-classification pipeline (default: simple)",
    )
    p.add_argument(
        "--output", type=Path, help=".jsonl: one object per text (index, text, entities)"
    )
    add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    from ..api.engine import Engine  # torch only now: `pipepool ner --help` stays quick

    if not args.texts and args.input is None:
        raise InvalidInputError(
            "no texts: give TEXT arguments, --input FILE, or '-' to read stdin", param="input"
        )
    inputs = read_inputs(args.texts, args.input)
    if any(not isinstance(t, str) for t in inputs.items):
        raise InvalidInputError("ner takes texts, not token ids", param="input")
    if args.output is not None and args.output.suffix != ".jsonl":
        raise InvalidInputError(f"--output must end in .jsonl, got {args.output}", param="output")
    started = time.perf_counter()
    with Engine.from_config(engine_config(args)) as engine:
        loaded = time.perf_counter()
        found = engine.classify_tokens(inputs.items, aggregation_strategy=args.aggregation_strategy)
        done = time.perf_counter()
        tokens = engine.stats.prompt_tokens_finished
    _write(inputs.items, found, args.output)
    name = engine.info.model
    print(
        f"tagged {len(inputs.items)} texts ({tokens} tokens) with {name}"
        f"\n  load {loaded - started:.2f}s, ner {done - loaded:.2f}s",
        file=sys.stderr,
    )
    return 0


def _write(texts: list[str], found: list[list[dict]], output: Path | None) -> None:
    if output is None:
        for i, entities in enumerate(found):
            spans = ", ".join(
                f"{e.get('entity_group', e.get('entity'))} {e['word']!r} "
                f"[{e['start']}:{e['end']}] {e['score']:.3f}"
                for e in entities
            )
            print(f"[{i}] {spans or '(none)'}")
        return
    with open(output, "w", encoding="utf-8") as f:
        for i, (text, entities) in enumerate(zip(texts, found, strict=True)):
            f.write(json.dumps({"index": i, "text": text, "entities": entities}) + "\n")
