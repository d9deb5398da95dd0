"""``pipepool embed --input CORPUS --output-dir DIR``: a corpus (.jsonl, .parquet, .txt) into
sharded parquet, resumable.

The files and their rules are ``jobs.corpus_*``'s: the corpus read a shard at a time
(``corpus_input``), the manifest of settings (``corpus_manifest``), the shards
(``corpus_shards``). Here: the flags, the settings the vectors depend on, and the loop that
hands the engine one shard at a time and writes its vectors before reading the next.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InvalidInputError
from ..jobs import corpus_manifest
from ..jobs.corpus_files import locked, remove_leftovers
from ..jobs.corpus_input import Corpus, Shard
from ..jobs.corpus_manifest import Manifest
from ..jobs.corpus_rows import CorpusSpec, RowError
from .common import engine_config

if TYPE_CHECKING:
    import numpy as np

    from ..api.engine import Engine

__all__ = ["DEFAULT_SHARD_SIZE", "add_arguments", "run"]

DEFAULT_SHARD_SIZE = 10_000
_PROGRESS_MIN_INPUTS = 64
# ``embed`` flags with no meaning for a corpus job: refused, not silently ignored.
_NOT_WITH_OUTPUT_DIR = {
    "output": "--output",
    "top_k": "--top-k",
    "is_query": "--is-query",
    "no_text": "--no-text",
    "keep_blank": "--keep-blank",
}
# Engine options that change the vectors; the others (--pp, --dp, budgets, device) change
# how fast they come, not what they are, beyond float rounding. The device's effect that is
# more than rounding, the dtype "auto" picks, is in the resolved settings.
_ENGINE_SETTINGS = (
    "model", "dtype", "pooling", "normalize", "long_inputs", "max_model_len", "attention",
)  # fmt: skip
# Per-call options of ``embed`` that change the vectors.
_CALL_SETTINGS = ("dimensions", "prompt_name", "truncate_prompt_tokens")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The corpus job's flags, on ``embed``'s parser."""
    g = parser.add_argument_group(
        "corpus job (--output-dir)",
        "Embed the --input corpus (.jsonl objects, .parquet, or .txt: one text a line) into "
        "DIR/part-00000.parquet, ... (columns id and embedding), SHARD_SIZE input rows each, "
        "with DIR/manifest.json holding the settings. Rows are numbered from 1 (a line of a "
        ".txt/.jsonl file). A row that gives no vector (no text, not a string, not valid "
        "UTF-8 or JSON, refused by the engine) is a line of DIR/errors-00000.jsonl (row, id, "
        "error) and the job goes on (--errors does not apply). Rerunning the command after "
        "an interruption skips the finished shards; a manifest of other settings is refused "
        "(exit 2)",
    )
    g.add_argument("--output-dir", type=Path, metavar="DIR", help="where the shards go")
    g.add_argument(
        "--id-field",
        default="id",
        help=".jsonl key or .parquet column of the ids (default: id; where the corpus has "
        "none, the row number is the id, as for .txt)",
    )
    g.add_argument(
        "--text-field",
        default="text",
        help=".jsonl key or .parquet column of the texts (default: text)",
    )
    g.add_argument(
        "--shard-size",
        type=_positive_int,
        default=DEFAULT_SHARD_SIZE,
        help=f"input rows per shard (default: {DEFAULT_SHARD_SIZE:,}); memory holds one shard",
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    """The corpus job: exit 0 once every shard is on disk and the manifest says so."""
    import pyarrow  # noqa: F401 (before any file is touched: a missing extra is named first)

    corpus = _corpus(args)
    out: Path = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    with locked(out):
        return _run_locked(args, corpus, out)


def _run_locked(args: argparse.Namespace, corpus: Corpus, out: Path) -> int:
    from ..api.engine import Engine  # torch only now: a refused rerun stays quick
    from ..jobs.corpus_shards import finished_shards

    leftovers = remove_leftovers(out)
    request = _request_settings(args, corpus)
    recorded = corpus_manifest.load(out)
    done = finished_shards(out)
    if recorded is None and done:
        raise InvalidInputError(
            f"--output-dir {out} holds shards but no {corpus_manifest.NAME}: their settings "
            "are unknown, so no shard can be added to them; give another --output-dir",
            param="output_dir",
        )
    labels = _labels()
    if recorded is not None:
        corpus_manifest.check(out, recorded.settings, request, labels)
        if recorded.completed is not None and set(recorded.completed["shard_indices"]) <= done:
            print(f"{out}: already complete ({_describe(recorded.completed)})", file=sys.stderr)
            return 0
        removed = f", {len(leftovers)} partial file(s) removed" if leftovers else ""
        print(f"resuming in {out}: {len(done)} shard(s) done{removed}", file=sys.stderr)
    started = time.perf_counter()
    with Engine.from_config(engine_config(args)) as engine:
        settings = {**request, **_resolved_settings(engine, args)}
        if recorded is not None:
            corpus_manifest.check(out, recorded.settings, settings, labels)
        manifest = Manifest(settings, str(corpus.path.resolve()))
        loaded = time.perf_counter()
        job = _Job(engine, corpus, out, args, manifest, manifest_saved=recorded is not None)
        completed = job.run(done)
    corpus_manifest.save(out, Manifest(manifest.settings, manifest.input, completed))
    print(
        f"{corpus.path} -> {out}: {_describe(completed)}\n"
        f"  load {loaded - started:.2f}s, embed {time.perf_counter() - loaded:.2f}s",
        file=sys.stderr,
    )
    return 0


def _corpus(args: argparse.Namespace) -> Corpus:
    """The --input corpus, after refusing the flags that do not go with --output-dir."""
    given = [flag for dest, flag in _NOT_WITH_OUTPUT_DIR.items() if getattr(args, dest, None)]
    if args.texts:
        given.insert(0, "TEXT arguments")
    if args.output_type != "dense":
        given.append(f"--output-type {args.output_type}")
    if given:
        raise InvalidInputError(
            f"--output-dir embeds an --input corpus into parquet shards; it does not take "
            f"{', '.join(given)}",
            param="output_dir",
        )
    if args.input is None or args.input == "-":
        raise InvalidInputError(
            "--output-dir needs --input FILE (.jsonl, .parquet or .txt): a resumable job "
            "reads its rows again, which stdin cannot give",
            param="input",
        )
    corpus = Corpus(CorpusSpec(Path(args.input), args.id_field, args.text_field))
    if corpus.path.stat().st_size == 0:
        raise InvalidInputError(f"--input {corpus.path} is empty", param="input")
    return corpus


def _request_settings(args: argparse.Namespace, corpus: Corpus) -> dict[str, Any]:
    """What the vectors depend on that is known before the model loads: the corpus and the
    flags. A mismatch here is refused before any model is loaded."""
    config = engine_config(args)
    fields = corpus.spec.format != "txt"  # a .txt line has no fields
    return {
        "input_format": corpus.spec.format,
        "input_fingerprint": corpus_manifest.file_fingerprint(corpus.path),
        "id_field": args.id_field if fields else None,
        "text_field": args.text_field if fields else None,
        "id_kind": corpus.id_kind,
        "shard_size": args.shard_size,
        **{name: getattr(config, name) for name in _ENGINE_SETTINGS},
        **{name: getattr(args, name) for name in _CALL_SETTINGS},
    }


def _resolved_settings(engine: Engine, args: argparse.Namespace) -> dict[str, Any]:
    """What the loaded engine made of the flags: the model's files, its pooling,
    normalisation, dtype, length limit, vector size and prompt."""
    info = engine.info
    prompt_name = args.prompt_name if args.prompt_name is not None else info.default_prompt_name
    return {
        "model_path": info.model_path,
        "model_fingerprint": corpus_manifest.folder_fingerprint(Path(info.model_path)),
        "resolved_pooling": info.pooling,
        "resolved_normalize": info.normalize,
        "resolved_dtype": info.dtype,
        "resolved_max_model_len": info.max_model_len,
        "resolved_dim": args.dimensions or info.dimensions,
        "resolved_prompt": info.prompts.get(prompt_name) if prompt_name else None,
    }


def _labels() -> dict[str, str]:
    """Settings named by their flags in a mismatch error."""
    flags = ("id_field", "text_field", "shard_size", *_ENGINE_SETTINGS, *_CALL_SETTINGS)
    return {name: "--" + name.replace("_", "-") for name in flags}


@dataclass
class _Job:
    """One run of a corpus job: the engine, what it reads, where it writes. The manifest is
    saved before the first shard is written, not before the first engine call: a run whose
    first call fails (an unknown --prompt-name, a --dimensions too large) leaves no manifest
    that would refuse the corrected command."""

    engine: Engine
    corpus: Corpus
    out: Path
    args: argparse.Namespace
    manifest: Manifest
    manifest_saved: bool  # the folder's manifest says ``manifest.settings``

    def run(self, done: set[int]) -> dict[str, Any]:
        """Every shard not in ``done`` embedded and written, one at a time; returns what the
        finished job holds (the manifest's ``completed``)."""
        from ..jobs.corpus_shards import shard_counts

        shards = []
        for shard in self.corpus.shards(self.args.shard_size, skip=done):
            if shard.skipped:
                vectors, errors = shard_counts(self.out, shard.index)
            else:
                vectors, errors = self._embed(shard)
            assert vectors + errors == shard.num_rows, (shard.index, vectors, errors)
            shards.append({"index": shard.index, "rows": shard.num_rows, "errors": errors})
        return {
            "shard_indices": [s["index"] for s in shards],
            "rows": sum(s["rows"] for s in shards),
            "vectors": sum(s["rows"] - s["errors"] for s in shards),
            "errors": sum(s["errors"] for s in shards),
            "error_files": [f"errors-{s['index']:05d}.jsonl" for s in shards if s["errors"]],
        }

    def _embed(self, shard: Shard) -> tuple[int, int]:
        """Embed and write one shard; returns its (vectors, error rows)."""
        from ..jobs.corpus_shards import shard_path, write_shard

        dim = self.manifest.settings["resolved_dim"]
        ids, vectors, errors = _embed_shard(self.engine, shard, self.args, dim)
        if not self.manifest_saved:
            corpus_manifest.save(self.out, self.manifest)
            self.manifest_saved = True
        write_shard(self.out, shard.index, ids, vectors, errors, self.corpus.id_kind)
        last = shard.first_row + shard.num_rows - 1
        print(
            f"{shard_path(self.out, shard.index).name}: rows {shard.first_row}-{last}, "
            f"{len(ids)} vectors, {len(errors)} errors",
            file=sys.stderr,
        )
        return len(ids), len(errors)


def _embed_shard(
    engine: Engine, shard: Shard, args: argparse.Namespace, dim: int
) -> tuple[list[int | str], np.ndarray, list[RowError]]:
    """The ids and vectors of the shard's texts the engine takes (one engine call), and the
    shard's error rows, in row order: those read as such and those the engine refused. A
    refusal that names no input (a bad option) is the job's error, raised."""
    import numpy as np

    from ..api.progress import follow

    keep = list(range(len(shard.texts)))
    refused: list[RowError] = []
    options = {
        "dimensions": args.dimensions,
        "prompt_name": args.prompt_name,
        "truncate_prompt_tokens": args.truncate_prompt_tokens,
    }
    vectors = np.zeros((0, dim), dtype=np.float32)
    while keep:
        try:
            submission = _submit_whole(engine, [shard.texts[i] for i in keep], options)
        except InvalidInputError as exc:
            # Nothing of a refused call stays queued: drop the row it names and call again.
            if exc.index is None or not 0 <= exc.index < len(keep):
                raise
            i = keep.pop(exc.index)
            refused.append(RowError(shard.rows[i], shard.ids[i], _row_message(exc)))
            continue
        follow(
            submission,
            disable=args.no_progress or len(keep) < _PROGRESS_MIN_INPUTS,
            desc=f"shard {shard.index}",
        )
        vectors = submission.result()  # [len(keep), dim]
        break
    errors = sorted(shard.errors + refused, key=lambda e: e.row)
    return [shard.ids[i] for i in keep], vectors, errors


def _submit_whole(engine: Engine, texts: list[str], options: dict) -> Any:
    """The shard's texts as one batch, tokenised first: the scheduler then cuts the same steps
    however fast the texts were tokenised, so a shard computed again after an interruption is
    bit for bit the shard an uninterrupted run writes (``Engine.submit`` enqueues a long list a
    slice at a time, and where the slices fall in steps depends on timing). Over-long texts
    with ``--long-inputs chunk`` are windows of several requests: those go through ``submit``."""
    import numpy as np

    if engine.config.long_inputs == "chunk":
        return engine.submit(texts, **options)
    tokens = engine.tokenize(
        texts,
        prompt_name=options["prompt_name"],
        truncate_prompt_tokens=options["truncate_prompt_tokens"],
    )
    params = engine.info.pooling_params(dimensions=options["dimensions"])
    lengths = np.fromiter(map(len, tokens), np.int64, len(tokens))
    return engine.submit_tokens(np.concatenate(tokens), lengths, params)


def _row_message(exc: InvalidInputError) -> str:
    """The engine's refusal of one text, without its position in the call (the error row
    names the row): "input 3 is an empty string" -> "the text is an empty string"."""
    message = str(exc)
    position = f"input {exc.index} "
    return "the text " + message.removeprefix(position) if message.startswith(position) else message


def _describe(completed: dict[str, Any]) -> str:
    errors, files = completed["errors"], completed["error_files"]
    where = f" (in {', '.join(files[:3])}{', ...' if len(files) > 3 else ''})"
    return (
        f"{completed['rows']} rows in {len(completed['shard_indices'])} shard(s): "
        f"{completed['vectors']} vectors, {errors} error rows" + (where if errors else "")
    )
