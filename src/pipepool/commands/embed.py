"""``pipepool embed``: texts (arguments or a file) in, vectors out (printed, .npy or .jsonl)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from ..engine import Engine
from ..errors import InvalidInputError
from .common import add_engine_args, engine_config

_PROGRESS_MIN_INPUTS = 64


def add_parser(sub, help: str) -> None:
    p = sub.add_parser("embed", help=help, description=help)
    p.add_argument("texts", nargs="*", metavar="TEXT", help="texts to embed")
    p.add_argument(
        "--input",
        type=Path,
        help=".txt (one text per line) or .jsonl (strings, token-id lists, or objects with 'text')",
    )
    p.add_argument(
        "--output", type=Path, help=".npy (an [n, dim] array) or .jsonl (one object per input)"
    )
    p.add_argument("--dimensions", type=int, help="Matryoshka: keep the first N dimensions")
    p.add_argument(
        "--prompt-name", help="a prompt of the model's config_sentence_transformers.json"
    )
    p.add_argument(
        "--truncate-prompt-tokens",
        type=int,
        help="truncate longer prompts instead of failing (-1: max_model_len)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(p)


def read_inputs(texts: list[str], path: Path | None) -> list:
    items: list = list(texts)
    if path is not None:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidInputError(f"cannot read --input {path}: {exc}", param="input") from None
        if path.suffix == ".jsonl":
            for n, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InvalidInputError(
                        f"{path}:{n}: not valid JSON ({exc.msg})", param="input"
                    ) from None
                if isinstance(obj, dict):
                    obj = obj.get("text", obj.get("input"))
                if not isinstance(obj, (str, list)):
                    raise InvalidInputError(
                        f"{path}:{n}: expected a string, a token list or {{'text': ...}}",
                        param="input",
                    )
                items.append(obj)
        else:
            items += [line for line in lines if line.strip()]
    if not items:
        raise InvalidInputError("nothing to embed: give TEXT arguments or --input FILE")
    return items


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
    inputs = read_inputs(args.texts, args.input)
    check_output(args.output)
    started = time.perf_counter()
    with Engine.from_config(engine_config(args)) as engine:
        loaded = time.perf_counter()
        submission = engine.submit(
            inputs,
            dimensions=args.dimensions,
            prompt_name=args.prompt_name,
            truncate_prompt_tokens=args.truncate_prompt_tokens,
        )
        _progress(submission, disable=args.no_progress or len(inputs) < _PROGRESS_MIN_INPUTS)
        vectors = submission.result()
        done = time.perf_counter()
        stats = engine.stats
        _write(vectors, args.output)
        d = engine.deployment
        print(
            f"embedded {len(inputs)} inputs ({stats.prompt_tokens_finished} tokens) -> "
            f"{vectors.shape[1]}-dim vectors with {Path(engine.model_path).name} "
            f"[{d.num_stages} stage(s), {d.devices[0]}, {str(d.dtype).removeprefix('torch.')}]\n"
            f"  load {loaded - started:.2f}s, embed {done - loaded:.2f}s "
            f"({stats.prompt_tokens_finished / max(done - loaded, 1e-9):,.0f} tokens/s), "
            f"{stats.steps} steps, {stats.chunked_requests} chunked prompts",
            file=sys.stderr,
        )
    return 0


def _progress(submission, *, disable: bool) -> None:
    """A bar that moves as steps finish inputs (the engine loop reports each step)."""
    if disable:
        return
    from tqdm import tqdm

    bar = tqdm(total=submission.num_inputs, unit="input", file=sys.stderr)

    def catch_up(_: int) -> None:  # counts from num_done: nothing missed or counted twice
        bar.update(submission.num_done - bar.n)

    submission.add_progress_callback(catch_up)
    catch_up(0)  # what finished before the callback was in place
    submission.exception()  # wait
    bar.close()


def _write(vectors: np.ndarray, output: Path | None) -> None:
    if output is None:
        for i, v in enumerate(vectors):
            head = ", ".join(f"{x:+.4f}" for x in v[:6])
            print(f"[{i}] dim={len(v)} [{head}, ...]")
    elif output.suffix == ".npy":
        np.save(output, vectors)
    elif output.suffix == ".jsonl":
        with open(output, "w", encoding="utf-8") as f:
            for i, v in enumerate(vectors):
                f.write(json.dumps({"index": i, "embedding": v.tolist()}) + "\n")
    else:
        raise InvalidInputError(f"--output must end in .npy or .jsonl, got {output}")
