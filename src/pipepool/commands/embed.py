"""``pipepool embed``: texts (arguments, a file or stdin) in, vectors out (printed, .npy or
.jsonl; sparse and token vectors: ``embed_outputs.py``). Input files are read line for line by
``intake.text_files``. With ``--output-dir``, a resumable corpus job: ``embed_corpus.py``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InvalidInputError
from ..intake.text_files import ERROR_MODES, Inputs, UndecodableLineError, read_inputs
from . import embed_corpus, embed_late
from .common import add_engine_args, engine_config
from .input_lines import empty_text_ids, located

if TYPE_CHECKING:
    import numpy as np

    from ..api.engine import Engine

__all__ = ["add_parser", "check_output", "line_map_path", "read_inputs", "run"]

_PROGRESS_MIN_INPUTS = 64
OUTPUT_TYPES = ("dense", "sparse", "multi_vector")  # loading.retrieval.OUTPUTS, without torch
_NAMED_LINES = 5  # lines named on stderr when some were left out or changed


def add_parser(sub, help: str) -> None:
    p = sub.add_parser("embed", help=help, description=help)
    p.add_argument("texts", nargs="*", metavar="TEXT", help="texts to embed ('-': read stdin)")
    p.add_argument(
        "--input",
        help=".txt (one text per line), .jsonl (strings, token-id lists, or objects with "
        "'text'), .json (an array of those), or '-' for stdin (one text per line). Only \\n "
        "and \\r\\n end a line (a form feed, U+2028 or NEL stays inside its line)",
    )
    p.add_argument(
        "--output",
        type=Path,
        help=".npy (an [n, dim] array) or .jsonl (one object per input: index, text, "
        "embedding); for --output-type sparse .jsonl, for multi_vector .npz or .jsonl. When "
        "every row comes from the lines of one --input .txt/.jsonl file or stdin, "
        "OUTPUT.lines.txt is written next to it: one line per row, the 1-based input line "
        "number that row embeds (rows skip the lines left out)",
    )
    p.add_argument(
        "--output-type",
        choices=OUTPUT_TYPES,
        default="dense",
        help="what each input gives: dense, one vector (the default); sparse, its sparse "
        "vector (SPLADE, BGE-M3's lexical weights): .jsonl rows of index, text, indices "
        "(token ids, ascending) and values, printed as such rows without --output; "
        "multi_vector, one vector per token (ColBERT, BGE-M3): .npz (one [tokens, dim] array "
        "per row, named by the row's index: '0', '1', ...) or .jsonl rows with multi_vector. "
        "A model that does not give it: exit 2, naming those it gives",
    )
    p.add_argument("--top-k", type=int, help="sparse: keep each vector's K largest weights")
    p.add_argument(
        "--is-query",
        action="store_true",
        help="multi_vector of a ColBERT model: the query form (query prefix, [MASK] expansion "
        "to the query length) instead of the document form",
    )
    p.add_argument(
        "--no-text", action="store_true", help="leave the input text out of --output .jsonl rows"
    )
    p.add_argument(
        "--keep-blank",
        action="store_true",
        help="embed blank lines (empty or whitespace only) as rows of their own, as "
        "sentence-transformers embeds '' (the model's special tokens after any prompt); empty "
        "texts too. Default: blank lines are left out, counted on stderr, and OUTPUT.lines.txt "
        "maps rows to lines",
    )
    p.add_argument(
        "--errors",
        choices=ERROR_MODES,
        default="stop",
        help="a line that is not valid UTF-8: stop with an error naming it (default), skip it "
        "(counted on stderr, left out of OUTPUT.lines.txt), or replace its invalid bytes with "
        "U+FFFD and embed it",
    )
    p.add_argument("--dimensions", type=int, help="Matryoshka: keep the first N dimensions")
    p.add_argument(
        "--prompt-name", help="a prompt of the model's config_sentence_transformers.json"
    )
    p.add_argument(
        "--truncate-prompt-tokens",
        type=int,
        help="keep only the first N tokens of every input (-1: max_model_len)",
    )
    p.add_argument(
        "--late-chunking",
        action="store_true",
        help="each input is one document: one vector per chunk, each pooled from one pass over "
        "the whole document (late chunking). Chunks: --chunk-separator for text lines and TEXT "
        "arguments, or a .jsonl --input of chunk lists or {text, spans} objects "
        "(commands/embed_late.py)",
    )
    p.add_argument(
        "--chunk-separator",
        help="--late-chunking: what separates a text's chunks (e.g. ' | '); it belongs to no chunk",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    embed_corpus.add_arguments(p)
    add_engine_args(p)


def line_map_path(output: Path) -> Path:
    """Where the row->line map of ``output`` goes: ``<output>.lines.txt``."""
    return output.with_name(output.name + ".lines.txt")


def check_output(output: Path | None, output_type: str = "dense") -> None:
    """Before any work: a bad --output would otherwise fail only after embedding everything."""
    from .embed_outputs import SUFFIXES

    if output is None:
        return
    suffixes = SUFFIXES[output_type]
    if output.suffix not in suffixes:
        kind = "" if output_type == "dense" else f" for --output-type {output_type}"
        raise InvalidInputError(
            f"--output must end in {' or '.join(suffixes)}{kind}, got {output}", param="output"
        )
    if not output.parent.is_dir():
        raise InvalidInputError(
            f"--output {output}: folder {output.parent} does not exist", param="output"
        )


def run(args: argparse.Namespace) -> int:
    if args.late_chunking:
        return _late_chunked(args)
    if args.output_dir is not None:
        if args.chunk_separator is not None:
            raise InvalidInputError(
                "--chunk-separator applies to --late-chunking only", param="chunk_separator"
            )
        return embed_corpus.run(args)
    from ..api.engine import Engine  # torch only now: `pipepool embed --help` stays quick
    from . import embed_outputs

    if args.chunk_separator is not None:
        raise InvalidInputError(
            "--chunk-separator applies to --late-chunking only", param="chunk_separator"
        )

    try:
        inputs = read_inputs(args.texts, args.input, keep_blank=args.keep_blank, errors=args.errors)
    except UndecodableLineError as exc:
        if args.errors != "stop":
            raise
        hint = "; --errors skip leaves such lines out, --errors replace reads them with U+FFFD"
        raise InvalidInputError(f"{exc}{hint}", param="input") from None
    check_output(args.output, args.output_type)
    started = time.perf_counter()
    with Engine.from_config(engine_config(args)) as engine:
        loaded = time.perf_counter()
        if args.output_type == "dense":
            vectors = _embed(engine, inputs, args)
            what = f"{vectors.shape[1]}-dim vectors"
        else:
            rows = embed_outputs.encode(engine, inputs, args)
            what = embed_outputs.describe(args.output_type)
        done = time.perf_counter()
        if engine.config.trace:
            summary = engine.write_trace()
            print(f"{summary.text()}\ntrace written to {engine.config.trace}", file=sys.stderr)
        stats = engine.stats
        texts = None if args.no_text else inputs.items
        if args.output_type == "dense":
            _write(vectors, args.output, texts)
        else:
            embed_outputs.write(rows, args.output_type, args.output, texts)
        _report_lines(inputs, args.output)
        info = engine.info
        print(
            f"embedded {len(inputs.items)} inputs ({stats.prompt_tokens_finished} tokens) -> "
            f"{what} with {info.model} "
            f"[{_replicas(engine)}{info.num_stages} stage(s), {info.devices[0]}, {info.dtype}]\n"
            f"  load {loaded - started:.2f}s, embed {done - loaded:.2f}s "
            f"({stats.prompt_tokens_finished / max(done - loaded, 1e-9):,.0f} tokens/s), "
            f"{stats.steps} steps, {stats.chunked_requests} chunked prompts",
            file=sys.stderr,
        )
    return 0


def _late_chunked(args: argparse.Namespace) -> int:
    """``--late-chunking``: documents in, chunk vectors out (``embed_late.py``)."""
    from ..api.engine import Engine

    embed_late.check_args(args)
    started = time.perf_counter()
    with Engine.from_config(engine_config(args)) as engine:
        prompt = engine.info.prompt_text(args.prompt_name)
        documents = embed_late.read_documents(args, prompt)
        vectors = embed_late.embed_documents(engine, documents, args)
        embed_late.write(vectors, documents, args.output)
        chunks, tokens = sum(len(v) for v in vectors), engine.stats.prompt_tokens_finished
        name = engine.info.model
    print(
        f"late-chunked {len(documents)} documents into {chunks} chunk vectors ({tokens} "
        f"tokens) with {name} in {time.perf_counter() - started:.2f}s",
        file=sys.stderr,
    )
    return 0


def _embed(engine: Engine, inputs: Inputs, args: argparse.Namespace) -> np.ndarray:
    """One vector per item of ``inputs``, in order. With --keep-blank an empty text is
    embedded as sentence-transformers embeds "": the model's special tokens after any prompt
    ([CLS] [SEP] for BERT). The engine refuses empty texts, so those rows go as token ids,
    once: every empty text has the same vector."""
    import numpy as np

    from ..api.progress import follow

    items = inputs.items
    blank = [i for i, x in enumerate(items) if args.keep_blank and isinstance(x, str) and not x]
    rest = sorted(set(range(len(items))) - set(blank))
    options = {"dimensions": args.dimensions, "truncate_prompt_tokens": args.truncate_prompt_tokens}
    empty = None
    if blank:
        texts = all(isinstance(items[i], str) for i in rest)
        ids = empty_text_ids(engine, args.prompt_name, args.truncate_prompt_tokens, texts)
        try:
            empty = engine.submit([ids], **options)
        except InvalidInputError as exc:
            raise located(exc, [inputs.origins[blank[0]]]) from None
    if not rest:
        assert empty is not None
        return np.repeat(empty.result(), len(items), axis=0)
    try:
        submission = engine.submit(
            [items[i] for i in rest], prompt_name=args.prompt_name, **options
        )
    except InvalidInputError as exc:
        if empty is not None:
            empty.cancel()
        raise located(exc, [inputs.origins[i] for i in rest]) from None
    follow(submission, disable=args.no_progress or len(rest) < _PROGRESS_MIN_INPUTS)
    vectors = submission.result()  # [len(rest), dim]
    if empty is None:
        return vectors
    out = np.empty((len(items), vectors.shape[1]), dtype=vectors.dtype)
    out[rest] = vectors
    out[blank] = empty.result()[0]
    return out


def _report_lines(inputs: Inputs, output: Path | None) -> None:
    """On stderr: the lines left out or changed; next to ``output``, the row->line map."""
    if inputs.skipped_blank:
        print(
            f"skipped {inputs.skipped_blank} blank lines (--keep-blank embeds them)",
            file=sys.stderr,
        )
    for what, origins in (
        ("skipped {} lines that are not valid UTF-8", inputs.undecodable),
        ("replaced invalid UTF-8 with U+FFFD in {} lines", inputs.replaced),
    ):
        if origins:
            named = ", ".join(origins[:_NAMED_LINES]) + (
                ", ..." if len(origins) > _NAMED_LINES else ""
            )
            print(f"{what.format(len(origins))}: {named}", file=sys.stderr)
    lines = inputs.line_map()
    if output is None:
        return
    target = line_map_path(output)
    if lines is None:
        if inputs.skipped_blank or inputs.undecodable:
            print(
                f"no row->line map: the rows come from several sources ({target} not written)",
                file=sys.stderr,
            )
        return
    target.write_text("".join(f"{n}\n" for n in lines), encoding="utf-8")
    if inputs.skipped_blank or inputs.undecodable:
        print(f"row->line map written to {target}", file=sys.stderr)


def _replicas(engine) -> str:
    n = engine.info.data_parallel_size
    return f"{n} replicas x " if n > 1 else ""


def _write(vectors, output: Path | None, texts: list | None) -> None:
    import numpy as np

    if output is None:
        for i, v in enumerate(vectors):
            head = ", ".join(f"{x:+.4f}" for x in v[:6])
            print(f"[{i}] dim={len(v)} [{head}, ...]")
    elif output.suffix == ".npy":
        np.save(output, vectors)
    else:
        with open(output, "w", encoding="utf-8") as f:
            for i, v in enumerate(vectors):
                row: dict = {"index": i}
                if texts is not None:
                    key = "text" if isinstance(texts[i], str) else "token_ids"
                    row[key] = texts[i]
                row["embedding"] = v.tolist()
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
