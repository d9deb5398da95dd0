"""``pipepool embed --output-type sparse|multi_vector``: the sparse vector (SPLADE, BGE-M3's
lexical weights) or the token vectors (ColBERT, BGE-M3) of every input, from
``Engine.encode_outputs``, written as JSON lines or an .npz file. The inputs, blank lines and
the row->line map are ``embed``'s (``embed.py``): one row per input, in input order."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from ..errors import InvalidInputError
from ..intake.text_files import Inputs
from .input_lines import empty_text_ids, located

if TYPE_CHECKING:
    from ..api.engine import Engine
    from ..api.retrieval import RetrievalOutputs, SparseEmbedding

# The --output suffixes of each output type.
SUFFIXES = {"dense": (".npy", ".jsonl"), "sparse": (".jsonl",), "multi_vector": (".npz", ".jsonl")}


def encode(engine: Engine, inputs: Inputs, args: argparse.Namespace) -> list:
    """One row per item of ``inputs``, in order: a ``SparseEmbedding`` (sparse) or a
    ``[tokens, dim]`` array (multi_vector). A model that cannot give the output type is an
    ``InvalidInputError`` naming those it gives, before anything is computed. Blank texts
    (--keep-blank) go as the token ids of "", as ``embed`` sends them."""
    from ..api.retrieval import check_outputs

    kind = args.output_type
    check_outputs(engine.info.outputs, [kind])
    if args.dimensions is not None:
        raise InvalidInputError("--dimensions applies to dense vectors only", param="dimensions")
    items = inputs.items
    blank = [i for i, x in enumerate(items) if args.keep_blank and isinstance(x, str) and not x]
    rest = sorted(set(range(len(items))) - set(blank))
    options = {
        "top_k": args.top_k,
        "is_query": args.is_query,
        "truncate_prompt_tokens": args.truncate_prompt_tokens,
    }
    rows: list = [None] * len(items)
    if rest:
        try:
            out = engine.encode_outputs(
                [items[i] for i in rest], (kind,), prompt_name=args.prompt_name, **options
            )
        except InvalidInputError as exc:
            raise located(exc, [inputs.origins[i] for i in rest]) from None
        for i, row in zip(rest, _rows(out, kind), strict=True):
            rows[i] = row
    if blank:
        texts = all(isinstance(items[i], str) for i in rest)
        ids = empty_text_ids(engine, args.prompt_name, args.truncate_prompt_tokens, texts)
        empty = _rows(engine.encode_outputs([ids.tolist()], (kind,), **options), kind)[0]
        for i in blank:
            rows[i] = empty
    return rows


def describe(kind: str) -> str:
    """What the rows are, for the summary line."""
    return "sparse vectors" if kind == "sparse" else "token vectors (multi-vector)"


def write(rows: list, kind: str, output: Path | None, texts: list | None) -> None:
    """Rows to ``output``: .jsonl (one object per row: index, the text unless ``texts`` is
    None, then ``indices`` and ``values`` or ``multi_vector``) or .npz (multi_vector: one array
    per row, named by its index). No ``output``: sparse rows printed as those JSON lines, token
    vectors as one summary line each."""
    import numpy as np

    if output is not None and output.suffix == ".npz":
        np.savez(output, **{str(i): r for i, r in enumerate(rows)})
        return
    if output is None and kind == "multi_vector":
        for i, r in enumerate(rows):
            head = ", ".join(f"{x:+.4f}" for x in r[0][:6]) if len(r) else ""
            print(f"[{i}] tokens={r.shape[0]} dim={r.shape[1]} [[{head}, ...], ...]")
        return
    if output is None:
        _write_lines(rows, kind, texts, sys.stdout)
        return
    with open(output, "w", encoding="utf-8") as f:
        _write_lines(rows, kind, texts, f)


def _write_lines(rows: list, kind: str, texts: list | None, f: TextIO) -> None:
    for i, r in enumerate(rows):
        row: dict = {"index": i}
        if texts is not None:
            row["text" if isinstance(texts[i], str) else "token_ids"] = texts[i]
        row.update(_sparse_fields(r) if kind == "sparse" else {"multi_vector": r.tolist()})
        f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _rows(out: RetrievalOutputs, kind: str) -> list:
    rows = out.sparse if kind == "sparse" else out.multi_vector
    assert rows is not None, f"asked for {kind} outputs"
    return list(rows)


def _sparse_fields(s: SparseEmbedding) -> dict[str, list]:
    return {"indices": s.indices.tolist(), "values": s.values.tolist()}
