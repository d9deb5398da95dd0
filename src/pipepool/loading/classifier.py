"""What a classifier checkpoint computes on top of its final hidden states, decided once on the
driver from the model folder (no torch here: the last stage builds the head from it).

Heads, by checkpoint:
- BERT ``*ForSequenceClassification`` (cross-encoders such as ms-marco-MiniLM): the pooler
  (dense + tanh) on the [CLS] row, then ``classifier``.
- RoBERTa / XLM-R ``*ForSequenceClassification`` (bge-reranker): ``classifier.dense`` + tanh +
  ``classifier.out_proj`` on the <s> row.
- ModernBERT ``*ForSequenceClassification`` (gte-reranker-modernbert-base): ``head`` (dense,
  activation, LayerNorm) on the [CLS] row, then ``classifier``.
- DistilBERT ``*ForSequenceClassification``: ``pre_classifier`` + ReLU on the [CLS] row, then
  ``classifier``.
- ELECTRA ``*ForSequenceClassification`` (ms-marco-electra-base): ``classifier.dense`` + GELU +
  ``classifier.out_proj`` on the first token.
- DeBERTa-v2 ``*ForSequenceClassification`` (mxbai-rerank-base-v1): ``pooler.dense`` + the
  config's ``pooler_hidden_act`` on the [CLS] row, then ``classifier``.
- Decoder ``*ForSequenceClassification`` (Qwen2/Qwen3/Llama/Mistral): ``score`` (no bias) on
  the last token.
- Qwen3-Reranker's causal checkpoints: the LM head's "yes" and "no" rows on the last token of
  the model's published prompt; the score is logit(yes) - logit(no), whose sigmoid is P(yes).
  Only those two rows of the LM head (or of the tied embedding) are ever read.

Scores go through the activation sentence-transformers' ``CrossEncoder`` applies: the one its
config names (``activation_fn`` in config_sentence_transformers.json or in config.json's
``sentence_transformers``, or the legacy ``sbert_ce_default_activation_function``), else sigmoid
for one label and softmax for several (the probabilities vLLM's classify returns, and
``CrossEncoder.predict(..., apply_softmax=True)``). A request may ask for the raw logits.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Collection

from ..core.classifier_head import RERANKERS, ClassifierHead
from ..errors import ModelLoadError
from .model_folder import ModelFolder

# sentence-transformers stores the activation as the class's import path.
_ST_ACTIVATIONS = {
    "Identity": "identity",
    "Sigmoid": "sigmoid",
    "Softmax": "softmax",
    "Tanh": "tanh",
    "ReLU": "relu",
}


def read_classifier(
    folder: ModelFolder,
    *,
    family: str,
    decoder: bool,
    head_kind: str,
    reranker: str,
    checkpoint_names: Collection[str],
    model_name: str | None,
) -> ClassifierHead | None:
    """The head of a classifier checkpoint; None for an embedding model. ``head_kind``: what the
    family's ``*ForSequenceClassification`` puts on its pooled row (one of HEAD_KINDS)."""
    if reranker not in RERANKERS:
        raise ModelLoadError(f"reranker must be one of {', '.join(RERANKERS)}; got {reranker!r}")
    template = _template(reranker, folder, model_name, family, decoder)
    if folder.architecture.endswith("ForTokenClassification"):
        # transformers' token-classification pipeline takes the softmax over the labels of
        # every token, whatever their number.
        labels = _labels(folder.hf_config)
        return ClassifierHead("token", len(labels), labels, "softmax", "pair")
    if folder.architecture.endswith("ForSequenceClassification"):
        labels = _labels(folder.hf_config)
        pooling = folder.hf_config.get("classifier_pooling")
        if pooling not in (None, "cls", "mean"):
            raise ModelLoadError(
                f"{folder.path}: classifier_pooling {pooling!r} is not supported (cls, mean are)"
            )
        activation = _activation(folder, len(labels))
        return ClassifierHead(head_kind, len(labels), labels, activation, template, pooling=pooling)
    if template == "qwen3":
        if not decoder:
            raise ModelLoadError(
                f"reranker='qwen3' needs a causal-LM checkpoint; {folder.architecture} is an "
                "encoder"
            )
        rows_from = "lm_head.weight" if "lm_head.weight" in checkpoint_names else ""
        if not rows_from and folder.hf_config.get("tie_word_embeddings", False):
            rows_from = "embed_tokens.weight"  # tied: the LM head is the embedding matrix
        if not rows_from:
            raise ModelLoadError(
                f"{folder.path}: a Qwen3-Reranker checkpoint needs its LM head (lm_head.weight), "
                "and this one has none and does not tie it to the embeddings"
            )
        yes_no = _token_ids(folder, ("yes", "no"))
        return ClassifierHead("yes_no", 1, ("yes",), "sigmoid", "qwen3", yes_no, rows_from)
    return None


def _template(
    reranker: str, folder: ModelFolder, model_name: str | None, family: str, decoder: bool
) -> str:
    if reranker != "auto":
        return "qwen3" if reranker == "qwen3" else "pair"
    # The folder name of a hub snapshot is its revision, so the whole path and the name the
    # user gave (a hub id) are both looked at.
    named = "reranker" in f"{model_name or ''} {folder.path}".lower()
    return "qwen3" if decoder and family == "qwen3" and named else "pair"


def _labels(hf: dict) -> tuple[str, ...]:
    id2label = hf.get("id2label") or {}
    count = int(hf.get("num_labels") or len(id2label) or 2)  # transformers' default is 2
    return tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count))


def _activation(folder: ModelFolder, num_labels: int) -> str:
    """sentence-transformers' CrossEncoder activation for this folder (see the module doc)."""
    path = None
    st_config = folder.path / "config_sentence_transformers.json"
    if st_config.is_file():
        try:
            path = json.loads(st_config.read_text(encoding="utf-8")).get("activation_fn")
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"cannot read {st_config}: {exc}") from None
    hf = folder.hf_config
    if path is None:
        path = (hf.get("sentence_transformers") or {}).get("activation_fn")
    if path is None:
        path = hf.get("sbert_ce_default_activation_function")
    if path is None:
        return "sigmoid" if num_labels == 1 else "softmax"
    if not str(path).startswith("torch."):
        # sentence-transformers ignores (with a warning) activations from outside torch unless
        # trust_remote_code is set; the default then applies.
        warnings.warn(f"{folder.path}: ignoring activation {path!r} (not torch's)", stacklevel=2)
        return "sigmoid" if num_labels == 1 else "softmax"
    name = _ST_ACTIVATIONS.get(str(path).rsplit(".", 1)[-1])
    if name is None:
        raise ModelLoadError(
            f"{folder.path}: classifier activation {path!r} is not supported "
            f"({', '.join(_ST_ACTIVATIONS)} are)"
        )
    return name


def _token_ids(folder: ModelFolder, tokens: tuple[str, ...]) -> tuple[int, ...]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder.tokenizer_file))
    found = [tokenizer.token_to_id(t) for t in tokens]
    missing = [t for t, i in zip(tokens, found, strict=True) if i is None]
    if missing:
        raise ModelLoadError(
            f"{folder.tokenizer_file} has no token {missing[0]!r}, which a Qwen3-Reranker "
            "scores with (logit of 'yes' against 'no')"
        )
    return tuple(i for i in found if i is not None)  # all of them, by the check above
