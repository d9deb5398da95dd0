"""The independent references for sparse and multi-vector retrieval (issue 33), each run by the
library that defines the model family, in a subprocess whose PYTHONPATH is that library's target
dir (install.sh; torch and numpy come from the venv):

    python tests/refs/run_reference.py <kind> <model_dir> <input.json> <output.npz>

kind ``pylate`` (PyLate's ColBERT), input keys:
    queries, documents: lists of texts
    pairs: [[query_index, document_index], ...] scored one pair at a time
    rerank: {"query": query_index, "documents": [document_index, ...]} (optional)
    batch_size: encode batch size (default 32)
  output keys: query/<i>, document/<i> (normalised token embeddings, as ``encode`` returns them),
  query_ids/<i>, query_mask/<i>, document_ids/<i> (the input ids and attention mask PyLate feeds
  the model for that text alone), pair_scores, rerank_ids, rerank_scores, config (JSON).

kind ``bge_m3`` (FlagEmbedding's BGEM3FlagModel), input keys:
    texts: list of texts; max_length: encode truncation length; batch_size (default 256)
    pairs: [[query, passage], ...]; weights: [dense, sparse, colbert] (optional)
    max_query_length, max_passage_length (optional; FlagEmbedding's default 512)
  output keys: dense (N x H), lexical_ids/<i> and lexical_values/<i> (the lexical-weight dict,
  ids ascending), colbert/<i>, input_ids/<i>, score/<mode> (``compute_score`` on all pairs as
  one batch) and score1/<mode> (one pair per batch; no padding effects), config (JSON).
"""

from __future__ import annotations

import json
import sys

import numpy as np


def run_pylate(model_dir: str, inputs: dict) -> dict[str, np.ndarray]:
    import torch
    from pylate import models, rank, scores

    model = models.ColBERT(model_name_or_path=model_dir, device="cpu")
    batch_size = inputs.get("batch_size", 32)
    out: dict[str, np.ndarray] = {}
    embeddings = {}
    for side, key, is_query in (("query", "queries", True), ("document", "documents", False)):
        texts = inputs[key]
        vecs = model.encode(texts, is_query=is_query, batch_size=batch_size)
        embeddings[side] = vecs
        for i, (text, vec) in enumerate(zip(texts, vecs, strict=True)):
            out[f"{side}/{i}"] = np.asarray(vec, dtype=np.float32)
            features = model.tokenize([text], is_query=is_query)
            out[f"{side}_ids/{i}"] = features["input_ids"][0].numpy()
            out[f"{side}_mask/{i}"] = features["attention_mask"][0].numpy()

    pair_scores = []
    for qi, di in inputs.get("pairs", []):
        q = torch.from_numpy(embeddings["query"][qi])[None]
        d = torch.from_numpy(embeddings["document"][di])[None]
        pair_scores.append(float(scores.colbert_scores(q, d)[0, 0]))
    out["pair_scores"] = np.array(pair_scores, dtype=np.float64)

    if "rerank" in inputs:
        qi, doc_ids = inputs["rerank"]["query"], inputs["rerank"]["documents"]
        ranked = rank.rerank(
            documents_ids=[doc_ids],
            queries_embeddings=[embeddings["query"][qi]],
            documents_embeddings=[[embeddings["document"][i] for i in doc_ids]],
        )[0]
        out["rerank_ids"] = np.array([r["id"] for r in ranked], dtype=np.int64)
        out["rerank_scores"] = np.array([r["score"] for r in ranked], dtype=np.float64)

    config = {
        "query_prefix_id": model.query_prefix_id,
        "document_prefix_id": model.document_prefix_id,
        "pad_token_id": model.tokenizer.pad_token_id,
        "query_length": model.query_length,
        "document_length": model.document_length,
        "do_query_expansion": model.do_query_expansion,
        "attend_to_expansion_tokens": model.attend_to_expansion_tokens,
        "skiplist": sorted(set(model.skiplist)),
    }
    out["config"] = np.array(json.dumps(config))
    return out


def run_bge_m3(model_dir: str, inputs: dict) -> dict[str, np.ndarray]:
    from FlagEmbedding import BGEM3FlagModel

    model = BGEM3FlagModel(model_dir, use_fp16=False, devices="cpu")
    texts, max_length = inputs["texts"], inputs["max_length"]
    encoded = model.encode(
        texts,
        batch_size=inputs.get("batch_size", 256),
        max_length=max_length,
        return_dense=True,
        return_sparse=True,
        return_colbert_vecs=True,
    )
    out: dict[str, np.ndarray] = {"dense": np.asarray(encoded["dense_vecs"], dtype=np.float32)}
    for i, text in enumerate(texts):
        weights = encoded["lexical_weights"][i]
        ids = sorted(int(k) for k in weights)
        out[f"lexical_ids/{i}"] = np.array(ids, dtype=np.int64)
        out[f"lexical_values/{i}"] = np.array([weights[str(k)] for k in ids], dtype=np.float32)
        out[f"colbert/{i}"] = np.asarray(encoded["colbert_vecs"][i], dtype=np.float32)
        ids = model.tokenizer(text, truncation=True, max_length=max_length)["input_ids"]
        out[f"input_ids/{i}"] = np.array(ids, dtype=np.int64)

    pairs = [tuple(p) for p in inputs.get("pairs", [])]
    if pairs:
        options = {k: inputs[k] for k in ("max_query_length", "max_passage_length") if k in inputs}
        weights = inputs.get("weights")
        for key, batch_size in (("score", len(pairs)), ("score1", 1)):
            result = model.compute_score(
                pairs, batch_size=batch_size, weights_for_different_modes=weights, **options
            )
            for mode, values in result.items():
                out[f"{key}/{mode}"] = np.array(values, dtype=np.float64)

    tok = model.tokenizer
    config = {
        "unused_token_ids": sorted(
            {tok.cls_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}
        ),
        "query_max_length": model.query_max_length,
        "passage_max_length": model.passage_max_length,
    }
    out["config"] = np.array(json.dumps(config))
    return out


RUNNERS = {"pylate": run_pylate, "bge_m3": run_bge_m3}


def main(kind: str, model_dir: str, input_path: str, output_path: str) -> None:
    with open(input_path) as f:
        inputs = json.load(f)
    np.savez(output_path, **RUNNERS[kind](model_dir, inputs))


if __name__ == "__main__":
    main(*sys.argv[1:])
