"""Tiny sparse and multi-vector retrieval checkpoints (issue 33) with random weights, each written
in the layout its own library saves, and the references they are checked against:

- SPLADE: a sentence-transformers SparseEncoder folder (BertForMaskedLM + SpladePooling), its
  reference sentence-transformers in the venv (``splade_reference``);
- BGE-M3: a tiny XLM-R in FlagEmbedding's layout (``colbert_linear.pt`` and ``sparse_linear.pt``
  beside the weights) with the sentence-transformers files of BAAI/bge-m3, its reference
  FlagEmbedding's ``BGEM3FlagModel``;
- PyLate ColBERT: a BERT + Dense projection folder written by PyLate, its reference PyLate.

FlagEmbedding and PyLate pin libraries other than the venv's, so they live in target dirs of
their own (tests/refs/install.sh) and run in a subprocess (``run_reference``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import tiny_models
import torch

ROOT = Path(__file__).resolve().parent.parent
REFS = Path(os.environ.get("PIPEPOOL_REFS_DIR", ROOT / ".refs"))
# Each reference's target dir and a package that shows it is installed there.
REFERENCE_DIRS = {"pylate": ("pylate", "pylate"), "bge_m3": ("flagembedding", "FlagEmbedding")}

# The tiny ColBERT's settings: a short query_length, so that query expansion (padding with
# [MASK]) shows on most queries, and a document_length the longer test texts exceed.
COLBERT_DIM = 16
QUERY_LENGTH = 12
DOCUMENT_LENGTH = 64


def _write_json(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2))


# -- SPLADE ------------------------------------------------------------------------------------


def build_splade(
    path: Path, pooling: str = "max", *, layout: str = "st6", num_layers: int = 2, seed: int = 0
) -> Path:
    """A SparseEncoder folder as ``SparseEncoder(modules=[MLMTransformer, SpladePooling]).save``
    writes it: naver/splade-v3's shape (BertForMaskedLM, decoder tied to the word embeddings,
    bert-base-uncased vocabulary), shrunk, with ``pooling`` "max" (SPLADE v2 and later) or "sum"
    (the first SPLADE) and activation relu (log1p(relu(logits))). The MLM decoder bias is drawn
    around -3, so that few logits are positive and the vectors are sparse, as a trained
    SPLADE's are, and a bias dropped by the engine shows.

    ``layout`` "st6": written by the venv's sentence-transformers 6 (module types
    ``sentence_transformers.sparse_encoder.modules.<module>.<Class>``, a transformer_task in
    sentence_bert_config.json, ``embedding_dimension`` in 1_SpladePooling/config.json);
    "st5": by sentence-transformers 5.3 from PyLate's target dir, the layout of the SPLADE
    folders on the Hub (``sentence_transformers.sparse_encoder.models.MLMTransformer``,
    ``word_embedding_dimension``, similarity "dot")."""
    import transformers

    mlm_dir = path.with_name(path.name + "-mlm")
    tiny_models._copy_minilm_tokenizer(mlm_dir)
    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        max_position_embeddings=512,
        type_vocab_size=2,
        initializer_range=0.1,
        architectures=["BertForMaskedLM"],
    )
    torch.manual_seed(seed)
    model = transformers.BertForMaskedLM(config).eval()
    with torch.no_grad():
        model.cls.predictions.bias.normal_(-3.0, 0.5)
    model.save_pretrained(str(mlm_dir))
    options = {"pooling_strategy": pooling, "activation_function": "relu"}
    if layout == "st5":
        _build_with("pylate", "splade", mlm_dir, path, options)
        return path
    assert layout == "st6", layout
    from sentence_transformers.sparse_encoder import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    modules = [MLMTransformer(str(mlm_dir), max_seq_length=512), SpladePooling(**options)]
    SparseEncoder(modules=modules, device="cpu").save(str(path))
    return path


def splade_reference(path: Path, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    """sentence-transformers' SparseEncoder on the folder: (token ids ascending, weights) of the
    non-zero entries of each text's vocabulary-sized vector."""
    from sentence_transformers.sparse_encoder import SparseEncoder

    model = SparseEncoder(str(path), device="cpu")
    vectors = model.encode(texts, convert_to_tensor=True, convert_to_sparse_tensor=True)
    result = []
    for vector in vectors:  # each a sparse COO tensor [vocab]
        vector = vector.coalesce()
        ids = vector.indices()[0].numpy()
        values = vector.values().float().numpy()
        keep = values != 0
        order = np.argsort(ids[keep])
        result.append((ids[keep][order], values[keep][order]))
    return result


# -- BGE-M3 ------------------------------------------------------------------------------------


def build_bge_m3(path: Path, *, num_layers: int = 2, seed: int = 0) -> Path:
    """BAAI/bge-m3's layout, shrunk: an XLMRobertaModel (8194 positions, pad 1) and an XLM-R
    style tokenizer (<s> <pad> </s> <unk> ... <mask>), ``colbert_linear.pt`` (Linear(H, H)) and
    ``sparse_linear.pt`` (Linear(H, 1)) as ``torch.save``d state dicts (keys ``weight``,
    ``bias``) beside them, where FlagEmbedding's ``EncoderOnlyEmbedderM3Runner.get_model``
    looks (the sparse bias set to 0.4, so that most tokens, not all, have a positive weight);
    and the sentence-transformers files the real repo ships (modules.json of
    Transformer, CLS Pooling, Normalize in the legacy ``sentence_transformers.models.*`` names;
    1_Pooling/config.json; sentence_bert_config.json; no 2_Normalize folder, as on the Hub)."""
    import transformers

    vocab_size = tiny_models._train_unigram(path)
    hidden = 64
    config = transformers.XLMRobertaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        max_position_embeddings=8194,
        type_vocab_size=1,
        layer_norm_eps=1e-5,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        initializer_range=0.1,
        architectures=["XLMRobertaModel"],
    )
    torch.manual_seed(seed)
    transformers.XLMRobertaModel(config).eval().save_pretrained(str(path))
    torch.save(torch.nn.Linear(hidden, hidden).state_dict(), path / "colbert_linear.pt")
    sparse_linear = torch.nn.Linear(hidden, 1)
    with torch.no_grad():  # most tokens get a positive weight, some are cut by the relu
        sparse_linear.bias.fill_(0.4)
    torch.save(sparse_linear.state_dict(), path / "sparse_linear.pt")

    legacy = "sentence_transformers.models."
    _write_json(
        path / "modules.json",
        [
            {"idx": 0, "name": "0", "path": "", "type": legacy + "Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": legacy + "Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": legacy + "Normalize"},
        ],
    )
    _write_json(
        path / "1_Pooling" / "config.json",
        {
            "word_embedding_dimension": hidden,
            "pooling_mode_cls_token": True,
            "pooling_mode_mean_tokens": False,
            "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False,
        },
    )
    _write_json(
        path / "sentence_bert_config.json", {"max_seq_length": 8192, "do_lower_case": False}
    )
    _write_json(
        path / "config_sentence_transformers.json",
        {"__version__": {"sentence_transformers": "2.2.2", "transformers": "4.33.0"}},
    )
    return path


def bge_m3_by_hand(path: Path, texts: list[str], max_length: int) -> dict:
    """BGE-M3's three outputs written out from FlagEmbedding's definitions (transformers in the
    venv, fp32, one text at a time), to pin down what the FlagEmbedding reference computes:
    dense = normalize(h[0]); lexical weights = max over positions of relu(sparse_linear(h)) per
    token id, dropping <s> </s> <pad> <unk> and zeros; colbert = normalize(colbert_linear(h[1:]))
    (the last token, </s>, kept). ``h`` is the last hidden state of the text tokenized with
    truncation to ``max_length`` (special tokens included)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    hidden = model.config.hidden_size
    colbert_linear, sparse_linear = torch.nn.Linear(hidden, hidden), torch.nn.Linear(hidden, 1)
    colbert_linear.load_state_dict(torch.load(path / "colbert_linear.pt", weights_only=True))
    sparse_linear.load_state_dict(torch.load(path / "sparse_linear.pt", weights_only=True))
    unused = {tokenizer.cls_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    unused.add(tokenizer.unk_token_id)
    out: dict = {"dense": [], "lexical_weights": [], "colbert": []}
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, truncation=True, max_length=max_length)["input_ids"]
            h = model(input_ids=torch.tensor([ids])).last_hidden_state[0]  # [len, hidden]
            out["dense"].append(torch.nn.functional.normalize(h[0], dim=-1).numpy())
            weights = torch.relu(sparse_linear(h))[:, 0].tolist()
            lexical: dict[int, float] = {}
            for token, w in zip(ids, weights, strict=True):
                if token not in unused and w > lexical.get(token, 0.0):
                    lexical[token] = w
            out["lexical_weights"].append(lexical)
            colbert = torch.nn.functional.normalize(colbert_linear(h[1:]), dim=-1)
            out["colbert"].append(colbert.numpy())
    out["dense"] = np.stack(out["dense"])
    return out


# -- PyLate ColBERT ----------------------------------------------------------------------------


def build_pylate(path: Path, *, num_layers: int = 2, seed: int = 0) -> Path:
    """A PyLate ColBERT folder written by PyLate's ``models.ColBERT(...).save`` (in a subprocess
    on PyLate's target dir): answerai-colbert-small's shape (a BertModel backbone with the
    bert-base-uncased vocabulary plus "[Q] " and "[D] " as added tokens, a bias-free Dense
    projection to COLBERT_DIM in 1_Dense), shrunk, with query_length QUERY_LENGTH,
    document_length DOCUMENT_LENGTH, query expansion on, attend_to_expansion_tokens False and
    PyLate's default skiplist (string.punctuation)."""
    backbone = tiny_models.make_bert(
        path.with_name(path.name + "-backbone"), num_layers=num_layers, seed=seed
    )
    options = {
        "seed": seed,
        "embedding_size": COLBERT_DIM,
        "query_prefix": "[Q] ",
        "document_prefix": "[D] ",
        "query_length": QUERY_LENGTH,
        "document_length": DOCUMENT_LENGTH,
        "do_query_expansion": True,
        "attend_to_expansion_tokens": False,
    }
    _build_with("pylate", "pylate", backbone, path, options)
    return path


def _build_with(kind: str, what: str, source: Path, path: Path, options: dict) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        options_path = Path(tmp) / "options.json"
        options_path.write_text(json.dumps(options))
        script = ROOT / "tests" / "refs" / "build.py"
        _run(kind, [str(script), what, str(source), str(path), str(options_path)])


# -- running the references --------------------------------------------------------------------


def reference_env(kind: str) -> dict[str, str]:
    """The environment of a reference subprocess: PYTHONPATH is the kind's target dir alone,
    offline. Skips the test where the target dir is missing, except under CI, which installs it
    (tests/refs/install.sh) and so fails instead."""
    dirname, package = REFERENCE_DIRS[kind]
    target = REFS / dirname
    if not (target / package).is_dir():
        reason = f"{kind} reference not installed in {target}: run tests/refs/install.sh"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        PYTHONPATH=str(target),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        CUDA_VISIBLE_DEVICES="",
        TRANSFORMERS_VERBOSITY="error",
    )
    return env


def _run(kind: str, args: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, *args],
        env=reference_env(kind),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        raise AssertionError(f"{kind} reference failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def run_reference(kind: str, model_dir: Path, inputs: dict) -> dict:
    """Runs tests/refs/run_reference.py for ``kind`` ("pylate" or "bge_m3") on ``inputs`` (its
    docstring lists the keys) and returns its outputs: lists for the per-text keys, in text
    order (``query``, ``document``, ``colbert``, ...), ``lexical_weights`` as {token id: weight}
    dicts for bge_m3, ``score``/``score1`` as {mode: array}, ``config`` as a dict."""
    with tempfile.TemporaryDirectory() as tmp:
        input_path, output_path = Path(tmp) / "input.json", Path(tmp) / "output.npz"
        input_path.write_text(json.dumps(inputs))
        script = ROOT / "tests" / "refs" / "run_reference.py"
        _run(kind, [str(script), kind, str(model_dir), str(input_path), str(output_path)])
        with np.load(output_path) as npz:
            flat = {key: npz[key] for key in npz.files}
    return _unflatten(flat)


def _unflatten(flat: dict[str, np.ndarray]) -> dict:
    """Turns "name/i" keys into lists ordered by i ({mode: array} for the score keys)."""
    out: dict = {}
    for key, value in flat.items():
        name, _, sub = key.partition("/")
        if not sub:
            out[name] = json.loads(str(value)) if name == "config" else value
        elif name in ("score", "score1"):
            out.setdefault(name, {})[sub] = value
        else:
            out.setdefault(name, {})[int(sub)] = value
    for name, value in out.items():
        if isinstance(value, dict) and name not in ("score", "score1", "config"):
            out[name] = [value[i] for i in range(len(value))]
    if "lexical_ids" in out:
        out["lexical_weights"] = [
            dict(zip(ids.tolist(), values.tolist(), strict=True))
            for ids, values in zip(out["lexical_ids"], out["lexical_values"], strict=True)
        ]
    return out
