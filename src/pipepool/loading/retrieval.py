"""What a retrieval checkpoint computes beyond one dense vector, decided once on the driver from
the model folder (no torch here: the last stage builds the heads from it, ``stage/token_heads``).

- ``SpladeHead``: a sentence-transformers ``SparseEncoder`` (MLMTransformer + SpladePooling):
  the masked-LM head's logits for every token, ``log1p(relu(.))`` (twice log1p for
  ``log1p_relu``), max or sum over the prompt's tokens: one vocabulary-sized vector per text,
  mostly zeros (a sparse vector).
- ``M3Head``: BGE-M3 in FlagEmbedding's layout (``colbert_linear.pt`` and ``sparse_linear.pt``
  beside the XLM-R weights): from one forward, the [CLS] row (dense), ``relu(sparse_linear(h))``
  per token (lexical weights) and ``normalize(colbert_linear(h))`` for every token after the
  first (ColBERT vectors).
- ``ColbertHead``: a PyLate ColBERT folder: Dense projections of every token, normalised; query
  and document prefixes, queries padded with [MASK] to ``query_length`` (expansion tokens that
  other tokens do not attend to unless ``attend_to_expansion_tokens``), documents without
  their skiplist tokens. A sentence-transformers 6 MultiVectorEncoder folder makes one too
  (``read_multi_vector``): its prefixes are text prompts, its padding and skiplist its own.

Which outputs a model gives follows from its head (``outputs_of``): a model is never asked for
an output it cannot compute.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError
from .model_folder import ModelFolder
from .multi_vector import MultiVectorModules
from .st_dense import DenseModule

OUTPUTS = ("dense", "sparse", "multi_vector")

# The masked-LM head of each family a SparseEncoder may sit on: checkpoint tensor (canonical
# name) of each role; the decoder's weight is the word embedding where the checkpoint ties them.
_MLM_HEADS = {
    "bert": {
        "dense.weight": "cls.predictions.transform.dense.weight",
        "dense.bias": "cls.predictions.transform.dense.bias",
        "norm.weight": "cls.predictions.transform.LayerNorm.weight",
        "norm.bias": "cls.predictions.transform.LayerNorm.bias",
        "decoder.weight": "cls.predictions.decoder.weight",
        "decoder.bias": "cls.predictions.bias",
    },
    "distilbert": {
        "dense.weight": "vocab_transform.weight",
        "dense.bias": "vocab_transform.bias",
        "norm.weight": "vocab_layer_norm.weight",
        "norm.bias": "vocab_layer_norm.bias",
        "decoder.weight": "vocab_projector.weight",
        "decoder.bias": "vocab_projector.bias",
    },
    "roberta": {
        "dense.weight": "lm_head.dense.weight",
        "dense.bias": "lm_head.dense.bias",
        "norm.weight": "lm_head.layer_norm.weight",
        "norm.bias": "lm_head.layer_norm.bias",
        "decoder.weight": "lm_head.decoder.weight",
        "decoder.bias": "lm_head.bias",
    },
}
_WORD_EMBEDDINGS = "embeddings.word_embeddings.weight"
SPLADE_POOLINGS = ("max", "sum")
SPLADE_ACTIVATIONS = ("relu", "log1p_relu")


@dataclass(frozen=True)
class SpladeHead:
    """A SparseEncoder's masked-LM head and SpladePooling."""

    tensors: tuple[tuple[str, str], ...]  # (role, checkpoint tensor) of the MLM head
    activation: str  # the transform's activation (layers.activation name)
    eps: float  # its LayerNorm's
    vocab_size: int
    pooling: str  # one of SPLADE_POOLINGS
    splade_activation: str  # one of SPLADE_ACTIVATIONS


@dataclass(frozen=True)
class M3Head:
    """BGE-M3's extra heads (FlagEmbedding's ``*.pt`` state dicts); either may be absent."""

    colbert: Path | None  # colbert_linear.pt: Linear(hidden, colbert_dim)
    sparse: Path | None  # sparse_linear.pt: Linear(hidden, 1)
    colbert_dim: int


@dataclass(frozen=True)
class ColbertHead:
    """A late-interaction model (PyLate ColBERT, sentence-transformers MultiVectorEncoder):
    per-token projections and how texts become prompts."""

    dense: tuple[DenseModule, ...]
    query_prefix_id: int | None  # inserted after the first token ([CLS]); None: no prefix
    document_prefix_id: int | None
    query_length: int | None  # a query's tokens at most, prefix included (None: max_model_len)
    document_length: int | None  # a document's tokens at most, prefix included
    do_query_expansion: bool
    attend_to_expansion_tokens: bool
    mask_id: int  # what queries are padded with
    skiplist_ids: tuple[int, ...]  # tokens whose vectors are dropped (of documents)
    expansion_length: int  # queries are padded with mask_id up to this many tokens
    skip_in_queries: bool = False  # the skiplist applies to queries too
    normalize: bool = True  # vectors are L2-normalised unless the caller says otherwise
    # The prompts (sentence-transformers' prompts) put before queries and documents, where the
    # caller names none; None: the model's default prompt, if any.
    query_prompt_name: str | None = None
    document_prompt_name: str | None = None


@dataclass(frozen=True)
class M3Layout:
    """Where BGE-M3's outputs sit in a token's output row: the first ``width`` values hold the
    ColBERT vector (``colbert_dim`` of them, the rest zero) or, on a prompt's first row, whose
    ColBERT vector FlagEmbedding drops, the dense vector (``hidden`` values); value ``width``
    is the token's lexical weight."""

    hidden: int
    colbert_dim: int

    @property
    def width(self) -> int:
        return max(self.hidden, self.colbert_dim)

    @property
    def row_width(self) -> int:
        return self.width + 1


RetrievalHead = SpladeHead | M3Head | ColbertHead


def outputs_of(head: RetrievalHead | None) -> tuple[str, ...]:
    """The outputs a model with ``head`` gives (a plain embedding model: dense only)."""
    if isinstance(head, SpladeHead):
        return ("sparse",)
    if isinstance(head, ColbertHead):
        return ("multi_vector",)
    if isinstance(head, M3Head):
        return (
            ("dense",)
            + (("sparse",) if head.sparse else ())
            + (("multi_vector",) if head.colbert else ())
        )
    return ("dense",)


def read_splade(
    folder: ModelFolder, family: str, entries: dict, pooling: str, activation: str
) -> SpladeHead:
    """The MLM head a SparseEncoder folder's SpladePooling reads (``entries``: the checkpoint's
    canonical name -> entry with ``shape``)."""
    roles = _MLM_HEADS.get(family)
    if roles is None:
        raise ModelLoadError(
            f"{folder.path}: a SparseEncoder on the {family} family is not supported (its "
            f"masked-LM head is known for {', '.join(_MLM_HEADS)})"
        )
    hf = folder.hf_config
    tensors = dict(roles)
    if tensors["decoder.weight"] not in entries:
        if not hf.get("tie_word_embeddings", True):
            raise ModelLoadError(
                f"{folder.path}: the masked-LM decoder {tensors['decoder.weight']!r} is missing "
                "and the config does not tie it to the word embeddings"
            )
        tensors["decoder.weight"] = _WORD_EMBEDDINGS
    missing = sorted(name for name in tensors.values() if name not in entries)
    if missing:
        raise ModelLoadError(
            f"{folder.path}: a SparseEncoder needs the masked-LM head; missing weights: "
            f"{', '.join(missing)}"
        )
    vocab = int(hf["vocab_size"])
    hidden = int(hf.get("hidden_size", hf.get("dim", 0)))
    decoder = tuple(entries[tensors["decoder.weight"]].shape)
    if decoder != (vocab, hidden):
        raise ModelLoadError(
            f"{folder.path}: masked-LM decoder of shape {decoder}, expected {(vocab, hidden)}"
        )
    if family == "roberta":
        act = "gelu"  # RobertaLMHead's, whatever hidden_act says
    elif family == "distilbert":
        act = hf.get("activation", "gelu")
    else:
        act = hf.get("hidden_act", "gelu")
    if pooling not in SPLADE_POOLINGS or activation not in SPLADE_ACTIVATIONS:
        raise ModelLoadError(
            f"{folder.path}: SpladePooling {pooling!r} / {activation!r} is not supported "
            f"(pooling {', '.join(SPLADE_POOLINGS)}; activation {', '.join(SPLADE_ACTIVATIONS)})"
        )
    return SpladeHead(
        tensors=tuple(sorted(tensors.items())),
        activation=act,
        eps=float(hf.get("layer_norm_eps", 1e-12)),
        vocab_size=vocab,
        pooling=pooling,
        splade_activation=activation,
    )


def read_m3(folder: ModelFolder, hidden: int) -> M3Head | None:
    """BGE-M3's heads where the folder has FlagEmbedding's files, else None."""
    colbert = folder.path / "colbert_linear.pt"
    sparse = folder.path / "sparse_linear.pt"
    if not colbert.is_file() and not sparse.is_file():
        return None
    from .weights import load_pt_linear  # torch: only for folders that have these files

    colbert_dim = 0
    if colbert.is_file():
        colbert_dim = load_pt_linear(colbert, hidden, None).shape_out
    if sparse.is_file():
        load_pt_linear(sparse, hidden, 1)
    return M3Head(
        colbert=colbert if colbert.is_file() else None,
        sparse=sparse if sparse.is_file() else None,
        colbert_dim=colbert_dim,
    )


def read_retrieval(
    folder: ModelFolder, family: str, entries: dict, hidden: int
) -> RetrievalHead | None:
    """The retrieval head a folder asks for, or None (a dense embedding model)."""
    st = folder.st
    if st is not None and st.splade is not None:
        return read_splade(folder, family, entries, *st.splade)
    if st is not None and st.colbert_config is not None:
        return read_colbert(folder, st.colbert_dense, st.colbert_config)
    if st is not None and st.multi_vector is not None:
        return read_multi_vector(folder, st.multi_vector, st.prompts)
    return read_m3(folder, hidden)


# config_sentence_transformers.json keys of a PyLate model that pipepool applies (PyLate's
# defaults where absent), and those that do not change what is computed.
_COLBERT_DEFAULTS = {
    "query_prefix": "[Q] ",
    "document_prefix": "[D] ",
    "query_length": 32,
    "document_length": 180,
    "attend_to_expansion_tokens": False,
    "do_query_expansion": True,
    "skiplist_words": list(string.punctuation),
}
_COLBERT_INERT = {"__version__", "model_type", "prompts", "default_prompt_name",
                  "similarity_fn_name"}  # fmt: skip


def read_colbert(folder: ModelFolder, dense: tuple[DenseModule, ...], config: dict) -> ColbertHead:
    """A PyLate folder's head; token strings become ids as PyLate's tokenizer maps them (an
    unknown token maps to the unknown token's id)."""
    from tokenizers import Tokenizer

    unknown = sorted(set(config) - set(_COLBERT_DEFAULTS) - _COLBERT_INERT)
    if unknown:
        raise ModelLoadError(
            f"{folder.path}: ColBERT option {unknown[0]!r} is not supported (pipepool applies "
            f"{', '.join(_COLBERT_DEFAULTS)})"
        )
    prompts = {k: v for k, v in (config.get("prompts") or {}).items() if v}
    if prompts:
        raise ModelLoadError(f"{folder.path}: ColBERT prompts {sorted(prompts)} are not supported")
    options = {**_COLBERT_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    tok = Tokenizer.from_file(str(folder.tokenizer_file))
    specials = _special_tokens(folder.path)
    unk = tok.token_to_id(specials["unk_token"]) if "unk_token" in specials else None

    def token_id(text: str) -> int:
        found = tok.token_to_id(text)
        if found is None:
            found = unk
        if found is None:
            raise ModelLoadError(f"{folder.path}: token {text!r} is not in the vocabulary")
        return found

    mask = specials.get("mask_token") or specials.get("eos_token")
    if mask is None:
        raise ModelLoadError(f"{folder.path}: no [MASK] or EOS token to expand queries with")
    if options["document_length"] < 2 or options["query_length"] < 2:
        raise ModelLoadError(f"{folder.path}: query_length and document_length must be >= 2")
    return ColbertHead(
        dense=dense,
        query_prefix_id=token_id(options["query_prefix"]) if options["query_prefix"] else None,
        document_prefix_id=(
            token_id(options["document_prefix"]) if options["document_prefix"] else None
        ),
        query_length=int(options["query_length"]),
        document_length=int(options["document_length"]),
        do_query_expansion=bool(options["do_query_expansion"]),
        attend_to_expansion_tokens=bool(options["attend_to_expansion_tokens"])
        and bool(options["do_query_expansion"]),
        mask_id=token_id(mask),
        skiplist_ids=tuple(sorted({token_id(w) for w in options["skiplist_words"]})),
        expansion_length=int(options["query_length"]),
    )


def read_multi_vector(
    folder: ModelFolder, modules: MultiVectorModules, prompts: dict[str, str]
) -> ColbertHead:
    """A MultiVectorEncoder folder's head, as sentence-transformers 6 encodes: the "query"
    prompt before queries and the first of "document", "passage", "corpus" before documents;
    skiplist words that are not one token of the vocabulary dropped (sentence-transformers
    drops them rather than skip every unknown token); queries padded with the expansion token
    (the mask token unless the model names one, else EOS)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder.tokenizer_file))
    specials = _special_tokens(folder.path)
    expansion = modules.expansion
    token = expansion.token if expansion and expansion.token else None
    token = token or specials.get("mask_token") or specials.get("eos_token")
    mask_id = tok.token_to_id(token) if token else None
    if expansion is not None and mask_id is None:
        raise ModelLoadError(
            f"{folder.path}: query_expansion token {token!r} is not in the vocabulary"
        )
    skiplist = {tok.token_to_id(w) for w in modules.skiplist_words}
    query_length = modules.query_length
    if expansion is not None and expansion.strategy == "fixed":
        query_length = expansion.length  # the width every query has
    elif expansion is not None and query_length is not None:
        query_length = max(query_length, expansion.length)
    # sentence-transformers picks a prompt by its key: one saved as "" (its default for "query"
    # and "document") puts nothing before the text and hides a later one. A null prompt is
    # skipped here, where it would be taken and put nothing.
    named = {name for name, text in prompts.items() if isinstance(text, str)}
    document_prompt = next((p for p in ("document", "passage", "corpus") if p in named), None)
    return ColbertHead(
        dense=modules.dense,
        query_prefix_id=None,
        document_prefix_id=None,
        query_length=query_length,
        document_length=modules.document_length,
        do_query_expansion=expansion is not None,
        attend_to_expansion_tokens=bool(expansion and expansion.attend),
        mask_id=mask_id if mask_id is not None else -1,
        skiplist_ids=tuple(sorted(i for i in skiplist if i is not None)),
        expansion_length=expansion.length if expansion else 0,
        skip_in_queries="query" in modules.skiplist_tasks,
        normalize=modules.normalize,
        query_prompt_name="query" if "query" in named else None,
        document_prompt_name=document_prompt,
    )


def _special_tokens(path: Path) -> dict[str, str]:
    """The folder's special tokens by role (cls_token, mask_token, ...), as its tokenizer's
    ``special_tokens_map`` reads them."""
    names: dict[str, str] = {}
    for file in ("tokenizer_config.json", "special_tokens_map.json"):
        if (path / file).is_file():
            with open(path / file, encoding="utf-8") as f:
                for key, value in json.load(f).items():
                    text = value.get("content") if isinstance(value, dict) else value
                    if key.endswith("_token") and isinstance(text, str):
                        names[key] = text
    return names


def special_token_ids(folder: ModelFolder, roles: tuple[str, ...]) -> tuple[int, ...]:
    """Ids of the folder's special tokens of these roles (those it has), ascending."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder.tokenizer_file))
    specials = _special_tokens(folder.path)
    ids = {tok.token_to_id(specials[r]) for r in roles if r in specials}
    return tuple(sorted(i for i in ids if i is not None))
