"""Writes a folder with a reference library itself (run by tiny_retrieval's builders in a
subprocess whose PYTHONPATH is that library's target dir, see install.sh):

    python tests/refs/build.py <what> <source_dir> <out_dir> <options.json>

what ``pylate``: PyLate's ``models.ColBERT`` on the transformers checkpoint ``source_dir``. PyLate
adds its "[Q] " and "[D] " tokens to the tokenizer (resizing the embeddings) and appends a
bias-free Dense projection to ``embedding_size``, then ``ColBERT.save``, as a PyLate user does.
what ``splade``: sentence-transformers 5's SparseEncoder(MLMTransformer(source_dir),
SpladePooling(**options)).save, the layout most SPLADE folders on the Hub have."""

from __future__ import annotations

import json
import sys


def build_pylate(source: str, out_dir: str, options: dict) -> None:
    from pylate import models

    models.ColBERT(model_name_or_path=source, device="cpu", **options).save(out_dir)


def build_splade(source: str, out_dir: str, options: dict) -> None:
    from sentence_transformers.sparse_encoder import SparseEncoder
    from sentence_transformers.sparse_encoder.models import MLMTransformer, SpladePooling

    modules = [MLMTransformer(source, max_seq_length=512), SpladePooling(**options)]
    SparseEncoder(modules=modules, device="cpu").save(out_dir)


def main(what: str, source: str, out_dir: str, options_path: str) -> None:
    import torch

    with open(options_path) as f:
        options = json.load(f)
    # Seeds PyLate's random draws: the rows of the added prefix tokens (transformers' mean
    # resizing) and the Dense projection.
    torch.manual_seed(options.pop("seed", 0))
    {"pylate": build_pylate, "splade": build_splade}[what](source, out_dir, options)


if __name__ == "__main__":
    main(*sys.argv[1:])
