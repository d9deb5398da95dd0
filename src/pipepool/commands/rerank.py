"""``pipepool rerank``: documents (arguments, a file or stdin) ranked by a cross-encoder or
reranker against one query; prints the ranking, or writes it as JSON lines."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..errors import InvalidInputError
from .common import add_engine_args, engine_config
from .embed import read_inputs

_PREVIEW_CHARS = 72


def add_parser(sub, help: str) -> None:
    p = sub.add_parser("rerank", help=help, description=help)
    p.add_argument("--query", required=True, help="the query to rank the documents by")
    p.add_argument("documents", nargs="*", metavar="DOC", help="documents ('-': read stdin)")
    p.add_argument(
        "--input",
        help=".txt (one document per line), .jsonl (strings or objects with 'text'), .json (an "
        "array of those), or '-' for stdin",
    )
    p.add_argument("--top-n", type=int, help="print only the N most relevant documents")
    p.add_argument(
        "--instruction", help="Qwen3-Reranker's task instruction (default: its web-search one)"
    )
    p.add_argument(
        "--max-tokens-per-doc", type=int, help="cut each document to its first N tokens first"
    )
    p.add_argument(
        "--raw-scores", action="store_true", help="raw logits instead of the model's activation"
    )
    p.add_argument(
        "--output", type=Path, help=".jsonl: one object per document (rank, index, score, text)"
    )
    add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    from ..api.engine import Engine  # torch only now: `pipepool rerank --help` stays quick

    if not args.documents and args.input is None:
        raise InvalidInputError(
            "no documents to rank: give DOC arguments, --input FILE, or '-' to read stdin",
            param="input",
        )
    inputs = read_inputs(args.documents, args.input)
    if any(not isinstance(d, str) for d in inputs.items):
        raise InvalidInputError("documents must be texts, not token ids", param="input")
    if args.output is not None and args.output.suffix != ".jsonl":
        raise InvalidInputError(f"--output must end in .jsonl, got {args.output}", param="output")
    started = time.perf_counter()
    with Engine.from_config(engine_config(args)) as engine:
        loaded = time.perf_counter()
        try:
            ranked = engine.rerank(
                args.query,
                inputs.items,
                top_n=args.top_n,
                return_documents=True,
                instruction=args.instruction,
                max_tokens_per_doc=args.max_tokens_per_doc,
                use_activation=not args.raw_scores,
            )
        except InvalidInputError as exc:
            if exc.index is not None and 0 <= exc.index < len(inputs.origins):
                exc = type(exc)(f"{inputs.origins[exc.index]}: {exc}", param=exc.param)
            raise exc from None
        done = time.perf_counter()
        pairs, tokens = len(inputs.items), engine.stats.prompt_tokens_finished
    _write(ranked, args.output)
    name = engine.info.model
    print(
        f"ranked {pairs} documents ({tokens} tokens) with {name}\n"
        f"  load {loaded - started:.2f}s, rerank {done - loaded:.2f}s "
        f"({pairs / max(done - loaded, 1e-9):,.1f} pairs/s)",
        file=sys.stderr,
    )
    return 0


def _write(ranked, output: Path | None) -> None:
    if output is None:
        for rank, r in enumerate(ranked, 1):
            text = " ".join(r.document.split())
            if len(text) > _PREVIEW_CHARS:
                text = text[: _PREVIEW_CHARS - 3] + "..."
            print(f"{rank:>3}. [{r.index}] {r.relevance_score:+.6f}  {text}")
        return
    with open(output, "w", encoding="utf-8") as f:
        for rank, r in enumerate(ranked, 1):
            row = {"rank": rank, "index": r.index, "relevance_score": r.relevance_score}
            f.write(json.dumps({**row, "text": r.document}, ensure_ascii=False) + "\n")
