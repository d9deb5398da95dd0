"""Tiny sentence-transformers 6 ``MultiVectorEncoder`` folders (issue 56 item 5), written by
sentence-transformers itself (``MultiVectorEncoder(modules=...).save_pretrained``) on a tiny
random BERT, and their reference: the same library's ``encode_query`` / ``encode_document``."""

from __future__ import annotations

import string
from pathlib import Path

import numpy as np
import tiny_models
import torch

# Two layouts between them cover every setting pipepool reads:
# - "fixed": queries cut and padded to 12 tokens with [MASK] (not attended to), documents cut
#   at 64, punctuation skipped in documents, text prompts "[Q] " / "[D] ", one Dense, Normalize;
# - "min": queries padded to at least 8 tokens and cut at 20 (the padding attended to), no
#   document length, a skiplist (one word not in the vocabulary) on queries and documents, a
#   "passage" prompt that documents do not get (sentence-transformers saves its default ""
#   "document" prompt beside it, and that one wins), two Dense (Tanh with bias, then
#   Identity), no Normalize.
LAYOUTS = {
    "fixed": {
        "transformer": {
            "document_length": 64,
            "query_expansion": {"strategy": "fixed", "length": 12, "attend": False},
        },
        "dense": [(16, False, "Identity")],
        "skiplist": {"skiplist_words": list(string.punctuation)},
        "normalize": True,
        "prompts": {"query": "[Q] ", "document": "[D] "},
    },
    "min": {
        "transformer": {
            "query_length": 20,
            "query_expansion": {"strategy": "min", "length": 8, "attend": True},
        },
        "dense": [(32, True, "Tanh"), (16, False, "Identity")],
        "skiplist": {
            "skiplist_words": ["the", ",", "zzzqqqxxx"],
            "skiplist_tasks": ["query", "document"],
        },
        "normalize": False,
        "prompts": {"passage": "passage: "},
    },
}


def build_multi_vector(path: Path, layout: str, *, seed: int = 0) -> Path:
    """A MultiVectorEncoder folder of ``layout`` (``LAYOUTS``) at ``path``."""
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.base.modules.dense import Dense
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    spec = LAYOUTS[layout]
    backbone = tiny_models.make_bert(path.with_name(path.name + "-bert"), num_layers=2, seed=seed)
    transformer = Transformer(str(backbone), **spec["transformer"])
    torch.manual_seed(seed + 1)
    modules: list[torch.nn.Module] = [transformer]
    width = transformer.get_embedding_dimension()
    for out, bias, activation in spec["dense"]:
        act = torch.nn.Tanh() if activation == "Tanh" else torch.nn.Identity()
        dense = Dense(width, out, bias=bias, activation_function=act,
                      module_input_name="token_embeddings")  # fmt: skip
        torch.nn.init.normal_(dense.linear.weight, std=0.3)
        modules.append(dense)
        width = out
    modules.append(MultiVectorMask(**spec["skiplist"]))
    if spec["normalize"]:
        modules.append(Normalize(module_input_name="token_embeddings"))
    model = MultiVectorEncoder(modules=modules, prompts=spec["prompts"], device="cpu")
    model.save_pretrained(str(path))
    return path


def reference(path: Path, queries: list[str], documents: list[str]) -> dict[str, list]:
    """sentence-transformers' own token vectors of ``queries`` and ``documents``."""
    from sentence_transformers import MultiVectorEncoder

    model = MultiVectorEncoder(str(path), device="cpu")
    return {
        "query": [np.asarray(v) for v in model.encode_query(queries, convert_to_numpy=True)],
        "document": [
            np.asarray(v) for v in model.encode_document(documents, convert_to_numpy=True)
        ],
    }
