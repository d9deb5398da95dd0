"""``pipepool embed --late-chunking``: documents in, one vector per chunk out, each chunk pooled
from one pass over its whole document (``api.late_chunking`` states the rule).

Documents and their chunks:
- TEXT arguments, a .txt file (one document per line) or stdin, with ``--chunk-separator SEP``:
  the chunks of a document are its pieces between separators, each pooled where it stands in
  the document as written (the separators belong to no chunk);
- a .jsonl file, one document per line: a JSON list of strings (consecutive chunks, joined
  with one space, as Jina's ``late_chunking`` joins them), or an object ``{"text": ..., "spans":
  [[start, end], ...]}`` (character spans of the text, in order, not overlapping).
Rows come out in document order, then chunk order: printed, an ``[n_chunks, dim]`` .npy, or
.jsonl rows ``{document, chunk, start, end, embedding}`` (``start``/``end``: the chunk's span
in the document's text)."""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InvalidInputError

if TYPE_CHECKING:
    import numpy as np

    from ..api.engine import Engine
    from ..api.late_chunking import LateChunkedText

# Options of `embed` that late chunking cannot honour: refused by name, never dropped.
_REFUSED = {
    "output_dir": "--output-dir",
    "truncate_prompt_tokens": "--truncate-prompt-tokens",
    "top_k": "--top-k",
}


def check_args(args: argparse.Namespace) -> None:
    """Before any work: options late chunking does not take are refused by name."""
    for field, flag in _REFUSED.items():
        if getattr(args, field, None) is not None:
            raise InvalidInputError(
                f"{flag} does not apply to --late-chunking (each document is embedded whole)",
                param=field,
            )
    if args.output_type != "dense" or args.is_query or args.keep_blank:
        flag = (
            "--output-type"
            if args.output_type != "dense"
            else ("--is-query" if args.is_query else "--keep-blank")
        )
        raise InvalidInputError(
            f"{flag} does not apply to --late-chunking (dense chunk vectors of text documents)",
            param="late_chunking",
        )
    if args.output is not None and args.output.suffix not in (".npy", ".jsonl"):
        raise InvalidInputError(
            f"--output must end in .npy or .jsonl, got {args.output}", param="output"
        )


def read_documents(args: argparse.Namespace, prompt: str) -> list[LateChunkedText]:
    """The documents of the TEXT arguments and --input, each with its chunks' spans (the
    model's ``prompt`` in front, belonging to no chunk)."""
    from ..api.late_chunking import LateChunkedText
    from ..intake.text_files import read_inputs

    path = args.input
    if path is not None and Path(path).suffix == ".jsonl":
        if args.texts:
            raise InvalidInputError(
                "give documents either as TEXT arguments or as a .jsonl --input, not both",
                param="input",
            )
        return [_from_json(line, where, prompt) for line, where in _json_lines(Path(path))]
    if args.chunk_separator is None:
        raise InvalidInputError(
            "--late-chunking of text lines needs --chunk-separator (or a .jsonl --input whose "
            "lines give each document's chunks)",
            param="chunk_separator",
        )
    inputs = read_inputs(args.texts, path, errors=args.errors)
    documents = []
    for text, where in zip(inputs.items, inputs.origins, strict=True):
        if not isinstance(text, str):
            raise InvalidInputError(f"{where}: late chunking takes texts", param="input")
        spans, at = [], 0
        for piece in text.split(args.chunk_separator):
            spans.append((at, at + len(piece)))
            at += len(piece) + len(args.chunk_separator)
        documents.append(LateChunkedText.from_spans(text, spans, prompt))
    return documents


def embed_documents(
    engine: Engine, documents: list[LateChunkedText], args: argparse.Namespace
) -> list[np.ndarray]:
    """Each document's ``[chunks, dim]`` vectors, in order; an error names the document."""
    from ..api.late_chunking import late_chunk

    out = []
    for i, document in enumerate(documents):
        try:
            out.append(late_chunk(engine, document, dimensions=args.dimensions).vectors)
        except InvalidInputError as exc:
            raise InvalidInputError(f"document {i}: {exc}", param=exc.param) from None
    return out


def write(vectors: list[np.ndarray], documents: list[LateChunkedText], output: Path | None) -> None:
    """Printed, .npy or .jsonl, as the module says."""
    import numpy as np

    if output is not None and output.suffix == ".npy":
        np.save(output, np.concatenate(vectors))
        return
    with (
        open(output, "w", encoding="utf-8") if output is not None else nullcontext(sys.stdout) as f
    ):
        for d, (doc, rows) in enumerate(zip(documents, vectors, strict=True)):
            for c, ((lo, hi), v) in enumerate(zip(doc.spans, rows, strict=True)):
                lo, hi = lo - doc.prompt_chars, hi - doc.prompt_chars
                if output is None:
                    head = ", ".join(f"{x:+.4f}" for x in v[:6])
                    print(f"[{d}.{c}] chars {lo}-{hi} dim={len(v)} [{head}, ...]", file=f)
                else:
                    row = {"document": d, "chunk": c, "start": lo, "end": hi,
                           "embedding": v.tolist()}  # fmt: skip
                    f.write(json.dumps(row) + "\n")


def _json_lines(path: Path):
    if not path.is_file():
        raise InvalidInputError(f"--input {path} does not exist", param="input")
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                yield line, f"{path.name}:{number}"


def _from_json(line: str, where: str, prompt: str) -> LateChunkedText:
    from ..api.late_chunking import LateChunkedText

    try:
        value = json.loads(line)
    except ValueError as exc:
        raise InvalidInputError(f"{where} is not JSON: {exc}", param="input") from None
    if isinstance(value, list) and value and all(isinstance(c, str) for c in value):
        return LateChunkedText.from_chunks(value, prompt)
    if isinstance(value, dict) and set(value) == {"text", "spans"}:
        text, spans = value["text"], value["spans"]
        if isinstance(text, str) and isinstance(spans, list):
            try:
                pairs = [(int(s), int(e)) for s, e in spans]
            except (TypeError, ValueError):
                pairs = None
            if pairs is not None:
                try:
                    return LateChunkedText.from_spans(text, pairs, prompt)
                except InvalidInputError as exc:
                    raise InvalidInputError(f"{where}: {exc}", param="input") from None
    raise InvalidInputError(
        f"{where}: a document is a JSON list of chunk strings, or an object with exactly "
        '"text" and "spans" ([[start, end], ...])',
        param="input",
    )
