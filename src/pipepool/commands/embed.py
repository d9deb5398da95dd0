"""``pipepool embed``: texts (arguments, a file or stdin) in, vectors out (printed, .npy or
.jsonl)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InvalidInputError
from .common import add_engine_args, engine_config

_PROGRESS_MIN_INPUTS = 64
STDIN = "-"


def add_parser(sub, help: str) -> None:
    p = sub.add_parser("embed", help=help, description=help)
    p.add_argument("texts", nargs="*", metavar="TEXT", help="texts to embed ('-': read stdin)")
    p.add_argument(
        "--input",
        help=".txt (one text per line), .jsonl (strings, token-id lists, or objects with "
        "'text'), .json (an array of those), or '-' for stdin (one text per line)",
    )
    p.add_argument(
        "--output",
        type=Path,
        help=".npy (an [n, dim] array) or .jsonl (one object per input: index, text, embedding)",
    )
    p.add_argument(
        "--no-text", action="store_true", help="leave the input text out of --output .jsonl rows"
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


@dataclass
class Inputs:
    """What to embed, and where each item came from (``file.txt:9``), for error messages."""

    items: list = field(default_factory=list)
    origins: list[str] = field(default_factory=list)

    def add(self, item, origin: str) -> None:
        self.items.append(item)
        self.origins.append(origin)


def read_inputs(texts: list[str], path: str | Path | None) -> Inputs:
    """Inputs from TEXT arguments and ``--input`` (a file or ``-``), each with its origin."""
    inputs = Inputs()
    sources = []
    for k, text in enumerate(texts, 1):
        if text == STDIN:
            sources.append(STDIN)
        else:
            inputs.add(text, f"TEXT argument {k}")
    if path is not None:
        sources.append(str(path))
    for source in sources:
        before = len(inputs.items)
        _read_source(source, inputs)
        if len(inputs.items) == before:
            name = "stdin" if source == STDIN else source
            raise InvalidInputError(
                f"{name} has nothing to embed (it is empty or has only blank lines)",
                param="input",
            )
    if not inputs.items:
        raise InvalidInputError(
            "nothing to embed: give TEXT arguments, --input FILE, or '-' to read stdin",
            param="input",
        )
    return inputs


def _read_source(source: str, inputs: Inputs) -> None:
    if source == STDIN:
        lines = sys.stdin.read().splitlines()
        for n, line in enumerate(lines, 1):
            if line.strip():
                inputs.add(line, f"<stdin>:{n}")
        return
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"cannot read --input {path}: {exc}", param="input") from None
    if path.suffix == ".json":
        _read_json_array(path, text, inputs)
    elif path.suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                inputs.add(_item(path, n, _parse(path, n, line)), f"{path}:{n}")
    else:
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                inputs.add(line, f"{path}:{n}")


def _read_json_array(path: Path, text: str, inputs: Inputs) -> None:
    if not text.strip():
        return
    data = _parse(path, None, text)
    if not isinstance(data, list):
        raise InvalidInputError(
            f"{path}: expected a JSON array of texts, got {type(data).__name__}", param="input"
        )
    for k, obj in enumerate(data):
        inputs.add(_item(path, f"element {k}", obj), f"{path} element {k}")


def _parse(path: Path, where, text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        at = f":{where}" if where is not None else f":{exc.lineno}"
        raise InvalidInputError(f"{path}{at}: not valid JSON ({exc.msg})", param="input") from None


def _item(path: Path, where, obj):
    if isinstance(obj, dict):
        obj = obj.get("text", obj.get("input"))
    if not isinstance(obj, (str, list)):
        sep = ":" if isinstance(where, int) else " "
        raise InvalidInputError(
            f"{path}{sep}{where}: expected a string, a token list or {{'text': ...}}",
            param="input",
        )
    return obj


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
    from ..api.progress import follow

    inputs = read_inputs(args.texts, args.input)
    check_output(args.output)
    started = time.perf_counter()
    with Engine.from_config(engine_config(args)) as engine:
        loaded = time.perf_counter()
        try:
            submission = engine.submit(
                inputs.items,
                dimensions=args.dimensions,
                prompt_name=args.prompt_name,
                truncate_prompt_tokens=args.truncate_prompt_tokens,
            )
        except InvalidInputError as exc:
            raise _located(exc, inputs) from None
        follow(submission, disable=args.no_progress or len(inputs.items) < _PROGRESS_MIN_INPUTS)
        vectors = submission.result()
        done = time.perf_counter()
        if engine.config.trace:
            summary = engine.write_trace()
            print(f"{summary.text()}\ntrace written to {engine.config.trace}", file=sys.stderr)
        stats = engine.stats
        _write(vectors, args.output, None if args.no_text else inputs.items)
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


def _replicas(engine) -> str:
    n = engine.config.data_parallel_size
    return f"{n} replicas x " if n > 1 else ""


def _located(exc: InvalidInputError, inputs: Inputs) -> InvalidInputError:
    """The engine's error with the line (or argument) the bad input came from."""
    if exc.index is None or not 0 <= exc.index < len(inputs.origins):
        return exc
    return type(exc)(f"{inputs.origins[exc.index]}: {exc}", param=exc.param, index=exc.index)


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
