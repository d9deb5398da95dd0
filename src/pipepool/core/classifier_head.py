"""What a classifier checkpoint computes on top of its final hidden states, as a plain value
(no torch, no files): ``loading.classifier`` decides it from a model folder, the models build
the head from it, and the config checks its options against the names here."""

from __future__ import annotations

from dataclasses import dataclass

# How causal-LM checkpoints rerank (EngineConfig.reranker): "qwen3" = Qwen3-Reranker's prompt
# and yes/no logits; "none" = they do not; "auto" = "qwen3" for Qwen3 checkpoints whose name
# says Reranker (Qwen/Qwen3-Reranker-*, and seq-cls conversions that keep the name).
RERANKERS = ("auto", "qwen3", "none")
HEAD_KINDS = (
    "bert", "roberta", "linear", "yes_no", "modernbert", "distilbert", "electra", "deberta",
    "token",
)  # fmt: skip
TEMPLATES = ("pair", "qwen3")
SCORE_ACTIVATIONS = ("identity", "sigmoid", "softmax", "tanh", "relu")


@dataclass(frozen=True)
class ClassifierHead:
    """A classifier's head and how its inputs are formed.

    ``template``: "pair" = two texts joined by the tokenizer's own pair encoding ([CLS] a [SEP]
    b [SEP] with token types); "qwen3" = Qwen3-Reranker's prompt around query and document.
    """

    kind: str  # one of HEAD_KINDS
    num_labels: int
    labels: tuple[str, ...]  # id2label, in label order
    activation: str  # one of SCORE_ACTIVATIONS
    template: str  # one of TEMPLATES
    token_rows: tuple[int, ...] = ()  # yes_no: vocabulary rows of "yes" and "no"
    rows_from: str = ""  # yes_no: the checkpoint tensor holding them (LM head or tied embedding)
    # The row the head reads where the checkpoint says (ModernBERT's classifier_pooling: cls or
    # mean); None: the family's (the first token of an encoder, the last of a decoder).
    pooling: str | None = None

    def __post_init__(self) -> None:
        assert self.kind in HEAD_KINDS and self.template in TEMPLATES
        assert self.activation in SCORE_ACTIVATIONS
        assert len(self.labels) == self.num_labels >= 1
        assert (self.kind == "yes_no") == bool(self.token_rows)

    @property
    def per_token(self) -> bool:
        """A token classifier (``*ForTokenClassification``: NER): logits for every token."""
        return self.kind == "token"

    @property
    def can_rerank(self) -> bool:
        """One score per pair (sentence-transformers' ``rank`` needs exactly one label)."""
        return self.num_labels == 1
