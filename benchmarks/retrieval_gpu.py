"""Issue 33 on the GPU: sparse and multi-vector outputs, pipepool against the Hugging Face peer
doing the same outputs on the same texts, in one process, systems alternated over rounds.

- ``splade``: a SPLADE-shaped SparseEncoder (BERT-base: 12 layers, hidden 768, vocabulary
  30522, random bf16 weights, max pooling): ``Retriever.embed_sparse`` against
  sentence-transformers' ``SparseEncoder.encode`` (its best batch size), both returning each
  text's non-zero (token id, weight) pairs on the host.
- ``m3dense``: the same model's dense vectors alone (``Engine.embed`` against the peer's dense
  half), which tells the model's throughput from the outputs' cost.
- ``m3``: a BGE-M3-shaped model (XLM-R large: 24 layers, hidden 1024, vocabulary 250002, random
  bf16 weights, random colbert_linear.pt / sparse_linear.pt): ``Engine.encode_outputs`` with
  dense + sparse + ColBERT against FlagEmbedding's ``BGEM3FlagModel.encode`` computed the way
  FlagEmbedding computes it (texts sorted by length, padded batches through transformers'
  XLMRobertaModel, the same two linear heads, its per-token lexical-weight loop and ColBERT
  cut): FlagEmbedding itself is not installable on the GPU machine (no package index there).

Texts: "queries" (4096 texts of 3-60 words, lognormal around 12) and "passages" (1024 texts of
100-300 words), words of the tokenizer's vocabulary; tokenisation included for every system.

    python benchmarks/retrieval_gpu.py --models splade,m3 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
CHECKPOINTS = Path("/tmp/pipepool-bench")
# --smoke: the same script on the CPU, 2 layers and 64 texts (checks the script, times nothing)
SMOKE = {"on": False}


def device() -> str:
    return "cpu" if SMOKE["on"] else "cuda"


def layers(n: int) -> int:
    return 2 if SMOKE["on"] else n


def sync() -> None:
    if not SMOKE["on"]:
        torch.cuda.synchronize()


def minilm() -> Path:
    from gpu_suite import minilm_folder

    return minilm_folder()


def build_splade() -> Path:
    import transformers

    dest = CHECKPOINTS / f"splade-shape{'-smoke' if SMOKE['on'] else ''}"
    if (dest / "modules.json").exists():
        return dest
    raw = json.loads((HERE / "configs" / "all-minilm-l6-v2.json").read_text())
    raw.update(hidden_size=768, num_hidden_layers=layers(12), num_attention_heads=12,
               intermediate_size=3072, architectures=["BertForMaskedLM"])  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(transformers.BertConfig(**raw)).to(torch.bfloat16)
    with torch.no_grad():  # a trained SPLADE's logits are mostly negative: sparse vectors
        model.cls.predictions.bias.normal_(-3.0, 0.5)
    mlm = dest.with_name(dest.name + "-mlm")
    model.save_pretrained(str(mlm))
    _tokenizer(mlm)
    from sentence_transformers.sparse_encoder import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    modules = [MLMTransformer(str(mlm), max_seq_length=512), SpladePooling("max")]
    SparseEncoder(modules=modules, device="cpu").save(str(dest))
    return dest


def build_m3() -> Path:
    import transformers

    dest = CHECKPOINTS / f"m3-shape{'-smoke' if SMOKE['on'] else ''}"
    if (dest / "colbert_linear.pt").exists():
        return dest
    config = transformers.XLMRobertaConfig(
        vocab_size=250002, hidden_size=1024, num_hidden_layers=layers(24), num_attention_heads=16,
        intermediate_size=4096, max_position_embeddings=8194, type_vocab_size=1,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5,
        architectures=["XLMRobertaModel"],
    )  # fmt: skip
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device()):
        model = transformers.XLMRobertaModel(config, add_pooling_layer=False)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(str(dest))
    del model
    torch.save(torch.nn.Linear(1024, 1024).to(torch.bfloat16).state_dict(),
               dest / "colbert_linear.pt")  # fmt: skip
    torch.save(torch.nn.Linear(1024, 1).to(torch.bfloat16).state_dict(), dest / "sparse_linear.pt")
    _tokenizer(dest)  # MiniLM's (ids < 30522 < 250002): the machine has no XLM-R tokenizer
    (dest / "1_Pooling").mkdir(exist_ok=True)
    (dest / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 1024, "pooling_mode_cls_token": True,
        "pooling_mode_mean_tokens": False}))  # fmt: skip
    (dest / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]))  # fmt: skip
    (dest / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 8192}))
    return dest


def _tokenizer(dest: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "vocab.txt"):  # fmt: skip
        if (minilm() / name).exists():
            shutil.copy(minilm() / name, dest / name)


def texts(kind: str) -> list[str]:
    from pipepool.commands.workloads import vocabulary_words

    rng = np.random.default_rng(0)
    words = np.asarray(vocabulary_words(minilm() / "tokenizer.json"))
    if kind == "queries":
        n = np.clip(np.rint(rng.lognormal(np.log(12), 0.8, 4096)), 3, 60).astype(int)
    else:
        n = rng.integers(100, 301, 1024)
    if SMOKE["on"]:
        n = n[:64]
    return [" ".join(words[rng.integers(0, len(words), size=k)]) for k in n]


# -- the peers -----------------------------------------------------------------------------


class SpladePeer:
    def __init__(self, folder: Path, batch_size: int) -> None:
        from sentence_transformers.sparse_encoder import SparseEncoder

        self.model = SparseEncoder(str(folder), device=device(),
                                   model_kwargs={"torch_dtype": torch.bfloat16})  # fmt: skip
        self.batch_size = batch_size

    def __call__(self, batch: list[str]):
        out = self.model.encode(batch, batch_size=self.batch_size, convert_to_tensor=True,
                                convert_to_sparse_tensor=True)  # fmt: skip
        return [v.coalesce().cpu() for v in out]


class M3Peer:
    """BGEM3FlagModel.encode's computation (FlagEmbedding 1.4: inference/embedder/encoder_only/
    m3.py), on transformers."""

    def __init__(self, folder: Path, batch_size: int, dense_only: bool = False) -> None:
        import transformers

        self.dense_only = dense_only
        self.tok = transformers.AutoTokenizer.from_pretrained(str(folder))
        self.model = transformers.XLMRobertaModel.from_pretrained(
            str(folder), dtype=torch.bfloat16, add_pooling_layer=False
        ).to(device()).eval()  # fmt: skip
        self.colbert = torch.nn.Linear(1024, 1024).to(torch.bfloat16).to(device())
        self.colbert.load_state_dict(torch.load(folder / "colbert_linear.pt"))
        self.sparse = torch.nn.Linear(1024, 1).to(torch.bfloat16).to(device())
        self.sparse.load_state_dict(torch.load(folder / "sparse_linear.pt"))
        self.unused = {self.tok.cls_token_id, self.tok.sep_token_id, self.tok.pad_token_id,
                       self.tok.unk_token_id}  # fmt: skip
        self.batch_size = batch_size

    @torch.inference_mode()
    def __call__(self, batch: list[str]):
        order = np.argsort([-len(t) for t in batch], kind="stable")
        dense, lexical, colbert = [None] * len(batch), [None] * len(batch), [None] * len(batch)
        for a in range(0, len(batch), self.batch_size):
            rows = order[a : a + self.batch_size]
            enc = self.tok([batch[i] for i in rows], padding=True, truncation=True,
                           max_length=8192, return_tensors="pt").to(device())  # fmt: skip
            h = self.model(**enc).last_hidden_state
            d = torch.nn.functional.normalize(h[:, 0], dim=-1)
            if self.dense_only:
                for j, v in zip(rows.tolist(), d.float().cpu().numpy(), strict=True):
                    dense[j] = v
                continue
            w = torch.relu(self.sparse(h)).squeeze(-1)
            c = self.colbert(h[:, 1:]) * enc["attention_mask"][:, 1:, None]
            c = torch.nn.functional.normalize(c, dim=-1)
            d, w, c = d.float().cpu().numpy(), w.float().cpu().numpy(), c.float().cpu().numpy()
            ids, mask = enc["input_ids"].cpu().numpy(), enc["attention_mask"].cpu().numpy()
            for j, i in enumerate(rows.tolist()):
                dense[i] = d[j]
                weights: dict[str, float] = {}
                for weight, idx in zip(w[j], ids[j], strict=True):
                    if idx not in self.unused and weight > 0:
                        key = str(idx)
                        if weight > weights.get(key, 0):
                            weights[key] = weight
                lexical[i] = weights
                colbert[i] = c[j][: int(mask[j].sum()) - 1]
        return dense if self.dense_only else (dense, lexical, colbert)


# -- pipepool ------------------------------------------------------------------------------


def run(models: list[str], rounds: int, batch_sizes: list[int]) -> list[dict]:
    from pipepool import Engine, Retriever

    rows = []
    for key in models:
        folder = build_splade() if key == "splade" else build_m3()
        make_peer = {
            "splade": SpladePeer,
            "m3": M3Peer,
            "m3dense": lambda f, b: M3Peer(f, b, dense_only=True),
        }[key]
        engine = Engine(str(folder), dtype="bfloat16", device=device())
        engine.pipeline.wait_until_compiled(600)
        if key == "splade":
            ours = Retriever(engine).embed_sparse
        elif key == "m3dense":
            ours = engine.embed
        else:

            def ours(batch, engine=engine):
                return engine.encode_outputs(batch, ["dense", "sparse", "multi_vector"])

        for kind in ("queries", "passages"):
            batch = texts(kind)
            peers = {}
            for b in batch_sizes:  # the peer's best batch size on a warm-up slice
                peer = make_peer(folder, b)
                peer(batch[: 4 * b])
                sync()
                t0 = time.perf_counter()
                peer(batch[: 8 * b])
                sync()
                peers[b] = (8 * b / (time.perf_counter() - t0), peer)
            best, (_, peer) = max(peers.items(), key=lambda item: item[1][0])
            ours(batch[:256])
            times: dict[str, list[float]] = {"pipepool": [], "peer": []}
            for _ in range(rounds):
                for name, fn in (("pipepool", ours), ("peer", peer)):
                    sync()
                    t0 = time.perf_counter()
                    result = fn(batch)
                    sync()
                    times[name].append(time.perf_counter() - t0)
                    if name == "pipepool":
                        mine = result
                    else:
                        theirs = result
            check = _agreement(key, mine, theirs)
            row = {
                "model": key, "texts": kind, "n": len(batch), "peer_batch_size": best,
                "pipepool_texts_per_s": len(batch) / statistics.median(times["pipepool"]),
                "peer_texts_per_s": len(batch) / statistics.median(times["peer"]),
                **check,
            }  # fmt: skip
            row["ratio"] = row["pipepool_texts_per_s"] / row["peer_texts_per_s"]
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                              for k, v in row.items()}), flush=True)  # fmt: skip
            rows.append(row)
            del peers, peer
            if not SMOKE["on"]:
                torch.cuda.empty_cache()
        engine.close()
    return rows


def _agreement(key: str, mine, theirs) -> dict:
    """bf16 both sides: how close the outputs are (a sanity check, not the parity bar)."""
    if key == "splade":
        overlap = []
        for m, t in zip(mine, theirs, strict=True):
            ids = set(t.indices()[0].tolist())
            overlap.append(len(ids & set(m.indices.tolist())) / max(len(ids), 1))
        return {"sparse_id_overlap_min": min(overlap)}
    if key == "m3dense":
        return {"dense_cos_min": float((mine * np.stack(theirs)).sum(1).min())}
    dense = float((mine.dense * np.stack(theirs[0])).sum(1).min())
    col = min(float((m * t).sum(1).min()) for m, t in zip(mine.multi_vector, theirs[2],
                                                          strict=True))  # fmt: skip
    return {"dense_cos_min": dense, "colbert_cos_min": col}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="splade,m3")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-sizes", default="32,128")
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    SMOKE["on"] = a.smoke
    rows = run(a.models.split(","), a.rounds, [int(b) for b in a.batch_sizes.split(",")])
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
