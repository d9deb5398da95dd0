"""``pipepool embed``: texts (arguments, a file or stdin) in, vectors out (printed, .npy or
.jsonl). Input files are read line for line by ``intake.text_files``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InvalidInputError
from ..intake.text_files import ERROR_MODES, Inputs, UndecodableLineError, read_inputs
from .common import add_engine_args, engine_config

if TYPE_CHECKING:
    import numpy as np

    from ..api.engine import Engine

__all__ = ["add_parser", "check_output", "line_map_path", "read_inputs", "run"]

_PROGRESS_MIN_INPUTS = 64
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
        "embedding). When every row comes from the lines of one --input .txt/.jsonl file or "
        "stdin, OUTPUT.lines.txt is written next to it: one line per row, the 1-based input "
        "line number that row embeds (rows skip the lines left out)",
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
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(p)


def line_map_path(output: Path) -> Path:
    """Where the row->line map of ``output`` goes: ``<output>.lines.txt``."""
    return output.with_name(output.name + ".lines.txt")


def check_output(output: Path | None) -> None:
    """Before any work: a bad --output would otherwise fail only after embedding everything."""
    if output is None:
        return
    if output.suffix not in (".npy", ".jsonl"):
        raise InvalidInputError(
            f"--output must end in .npy or .jsonl, got {output}", param="output"
        )
    if not output.parent.is_dir():
        raise InvalidInputError(
            f"--output {output}: folder {output.parent} does not exist", param="output"
        )


def run(args: argparse.Namespace) -> int:
    from ..api.engine import Engine  # torch only now: `pipepool embed --help` stays quick

    try:
        inputs = read_inputs(args.texts, args.input, keep_blank=args.keep_blank, errors=args.errors)
    except UndecodableLineError as exc:
        if args.errors != "stop":
            raise
        hint = "; --errors skip leaves such lines out, --errors replace reads them with U+FFFD"
        raise InvalidInputError(f"{exc}{hint}", param="input") from None
    check_output(args.output)
    started = time.perf_counter()
    with Engine.from_config(engine_config(args)) as engine:
        loaded = time.perf_counter()
        vectors = _embed(engine, inputs, args)
        done = time.perf_counter()
        if engine.config.trace:
            summary = engine.write_trace()
            print(f"{summary.text()}\ntrace written to {engine.config.trace}", file=sys.stderr)
        stats = engine.stats
        _write(vectors, args.output, None if args.no_text else inputs.items)
        _report_lines(inputs, args.output)
        d = engine.deployment
        print(
            f"embedded {len(inputs.items)} inputs ({stats.prompt_tokens_finished} tokens) -> "
            f"{vectors.shape[1]}-dim vectors with {Path(engine.model_path).name} "
            f"[{_replicas(engine)}{d.num_stages} stage(s), {d.devices[0]}, "
            f"{str(d.dtype).removeprefix('torch.')}]\n"
            f"  load {loaded - started:.2f}s, embed {done - loaded:.2f}s "
            f"({stats.prompt_tokens_finished / max(done - loaded, 1e-9):,.0f} tokens/s), "
            f"{stats.steps} steps, {stats.chunked_requests} chunked prompts",
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
        ids = _empty_text_ids(engine, args.prompt_name, args.truncate_prompt_tokens, texts)
        try:
            empty = engine.submit([ids], **options)
        except InvalidInputError as exc:
            raise _located(exc, [inputs.origins[blank[0]]]) from None
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
        raise _located(exc, [inputs.origins[i] for i in rest]) from None
    follow(submission, disable=args.no_progress or len(rest) < _PROGRESS_MIN_INPUTS)
    vectors = submission.result()  # [len(rest), dim]
    if empty is None:
        return vectors
    out = np.empty((len(items), vectors.shape[1]), dtype=vectors.dtype)
    out[rest] = vectors
    out[blank] = empty.result()[0]
    return out


def _empty_text_ids(
    engine: Engine, prompt_name: str | None, truncate: int | None, texts: bool
) -> np.ndarray:
    """Token ids of "" as the engine would make them were it to take an empty text: the
    prompt (``prompt_name``, else the model's default one; only where the other inputs are
    ``texts``, as the engine prompts no token ids) and the tokenizer's special tokens, cut as
    ``truncate`` (--truncate-prompt-tokens) cuts a text."""
    prep = engine.inputs
    name = prompt_name if prompt_name is not None else prep.default_prompt_name
    prefix = ""
    if name is not None and texts:
        if name not in prep.prompts:
            known = ", ".join(sorted(prep.prompts)) or "none"
            raise InvalidInputError(
                f"unknown prompt_name {name!r} (this model has: {known})", param="prompt_name"
            )
        prefix = prep.prompts[name]
    limit = prep.deployment.max_model_len if truncate == -1 else truncate
    ids = prep.tokenizer.encode_batch([prefix], max_tokens=limit if limit and limit > 0 else None)
    if not len(ids[0]):
        raise InvalidInputError(
            "an empty text has no tokens for this model (its tokenizer adds no special tokens "
            "and no prompt is set): there is nothing to embed for a blank line; leave "
            "--keep-blank off to skip blank lines",
            param="input",
        )
    return ids[0]


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
    n = engine.config.data_parallel_size
    return f"{n} replicas x " if n > 1 else ""


def _located(exc: InvalidInputError, origins: list[str]) -> InvalidInputError:
    """The engine's error with the line (or argument) the bad input came from; ``origins``:
    those of the inputs of the call that raised it."""
    if exc.index is None or not 0 <= exc.index < len(origins):
        return exc
    return type(exc)(f"{origins[exc.index]}: {exc}", param=exc.param, index=exc.index)


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
