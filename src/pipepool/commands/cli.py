"""``pipepool embed | rerank | ner | serve | run-batch | parity | bench``."""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
from types import ModuleType
from typing import NoReturn

from .. import __version__
from ..errors import PipepoolError
from .suggest import SuggestingParser

# name -> module under pipepool.commands (the name, "-" read as "_") with add_parser(subparsers)
# and run(args) -> int.
# Imported lazily: `serve` needs the server extras, the others must not.
SUBCOMMANDS = {
    "embed": "embed texts or token ids and print or save the vectors",
    "rerank": "rank documents by relevance to a query with a cross-encoder or reranker",
    "ner": "tag named entities of texts with a token classifier",
    "serve": "run an OpenAI-, TEI- and Cohere-compatible embedding and rerank server",
    "run-batch": "run a file of OpenAI batch requests offline (vLLM's run-batch), resumable",
    "batch-store": "check, back up or recover the Batch API's state directory (serve --state-dir)",
    "parity": "check vectors against transformers or PP=1, per request",
    "bench": "measure throughput against Hugging Face transformers",
}
# Modules a subcommand cannot run without, and the extra that installs them.
_EXTRAS = {
    "fastapi": "server",
    "uvicorn": "server",
    "pydantic": "server",
    "python_multipart": "server",
    "httpx": "server",
    # `bench --cpu-peers`: the ONNX export and runtime peers
    "onnx": "bench-cpu",
    "onnxscript": "bench-cpu",
    "onnxruntime": "bench-cpu",
    # `embed --output-dir`: the parquet shards
    "pyarrow": "jobs",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``command``, only that subcommand's module is imported (its flags
    come from it), the others are listed by name: ``pipepool --help`` imports no torch."""
    parser = SuggestingParser(
        prog="pipepool",
        description="Pipeline-parallel inference for pooling models (text and token embeddings, "
        "rerankers, classifiers).",
    )
    parser.add_argument("--version", action="version", version=f"pipepool {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help in SUBCOMMANDS.items():
        if command is None or name == command:
            _command_module(name).add_parser(sub, help=help)
        else:
            sub.add_parser(name, help=help, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in SUBCOMMANDS else "").parse_args(argv)
    try:
        module = _command_module(args.command)
        return int(module.run(args) or 0)
    except PipepoolError as exc:
        print(f"pipepool {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"pipepool {args.command}: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as exc:
        extra = _EXTRAS.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        print(
            f"pipepool {args.command}: needs the {extra} extras ({exc.name} is not installed): "
            f"pip install 'pipepool[{extra}]'",
            file=sys.stderr,
        )
        return 2


def _command_module(name: str) -> ModuleType:
    return importlib.import_module(f"pipepool.commands.{name.replace('-', '_')}")


def run_as_program() -> NoReturn:
    """The ``pipepool`` command (console script and ``python -m pipepool``): ``main``, then exit.

    The process is ours and ends here. CPython's finalization runs one more full collection
    over every object still alive, ~300,000 with torch and a model loaded: 3.9-5.3 s of a
    Ctrl-C'd ``--pp 2`` run's exit on a loaded 2-core machine, against 1.1 s with those objects
    frozen first (a frozen object is skipped by collections). Nothing of ours needs that
    collection: engines are closed and output files written by now, and the standard streams
    are flushed by the interpreter whatever the collector does."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run_as_program()
