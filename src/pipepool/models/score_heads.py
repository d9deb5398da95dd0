"""Classifier heads (see ``classifier.py``): modules of the last stage that turn a step's pooled
rows into logits. They hold checkpoint tensors like any layer (named and shape-checked by the
weight loader) but run on the pooled rows only, after the pooler picked them, in float32:
``[n, hidden]`` in, ``[n, num_labels]`` out, for the whole step at once."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..core.classifier_head import ClassifierHead
from ..layers.activation import get_activation
from .base import ScoreHeadModule, WeightSpec, linear_specs


def _linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """``layer(x)`` in float32 whatever the stage's dtype (the head is a few rows' work)."""
    bias = layer.bias.float() if layer.bias is not None else None
    return F.linear(x, layer.weight.float(), bias)


class BertClassifier(ScoreHeadModule):
    """BERT: the pooler (dense + tanh on the [CLS] row), then ``classifier``."""

    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.pooler = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(torch.tanh(_linear(x, self.pooler)), self.classifier)

    def weight_specs(self, param: str) -> list[WeightSpec]:
        h, n = self.pooler.in_features, self.classifier.out_features
        return linear_specs("pooler.dense", f"{param}.pooler", h, h, True) + linear_specs(
            "classifier", f"{param}.classifier", n, h, True
        )


class RobertaClassifier(ScoreHeadModule):
    """RoBERTa / XLM-R: ``classifier.dense`` + tanh + ``classifier.out_proj`` on the <s> row."""

    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(torch.tanh(_linear(x, self.dense)), self.out_proj)

    def weight_specs(self, param: str) -> list[WeightSpec]:
        h, n = self.dense.in_features, self.out_proj.out_features
        return linear_specs("classifier.dense", f"{param}.dense", h, h, True) + linear_specs(
            "classifier.out_proj", f"{param}.out_proj", n, h, True
        )


class ModernBertClassifier(ScoreHeadModule):
    """ModernBERT: ``head`` (dense, activation, LayerNorm) on the pooled row, then
    ``classifier``. The dense layer's bias follows the config's classifier_bias and the norm's
    its norm_bias; ``classifier`` always has one. Built by models/modernbert.py, which knows
    those switches."""

    def __init__(
        self, hidden: int, num_labels: int, *, activation: str, eps: float, dense_bias: bool,
        norm_bias: bool,
    ) -> None:  # fmt: skip
        super().__init__()
        self.dense = nn.Linear(hidden, hidden, bias=dense_bias)
        self.norm = nn.LayerNorm(hidden, eps=eps, bias=norm_bias)
        self.classifier = nn.Linear(hidden, num_labels)
        self.activation = get_activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.norm
        bias = norm.bias.float() if norm.bias is not None else None
        y = self.activation(_linear(x, self.dense))
        y = F.layer_norm(y, norm.normalized_shape, norm.weight.float(), bias, norm.eps)
        return _linear(y, self.classifier)

    def weight_specs(self, param: str) -> list[WeightSpec]:
        h, n = self.dense.in_features, self.classifier.out_features
        specs = linear_specs("head.dense", f"{param}.dense", h, h, self.dense.bias is not None)
        specs.append(WeightSpec("head.norm.weight", (h,), f"{param}.norm.weight"))
        if self.norm.bias is not None:
            specs.append(WeightSpec("head.norm.bias", (h,), f"{param}.norm.bias"))
        return specs + linear_specs("classifier", f"{param}.classifier", n, h, True)


class DistilBertClassifier(ScoreHeadModule):
    """DistilBERT: ``pre_classifier`` + ReLU on the [CLS] row, then ``classifier``."""

    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.pre_classifier = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(F.relu(_linear(x, self.pre_classifier)), self.classifier)

    def weight_specs(self, param: str) -> list[WeightSpec]:
        h, n = self.pre_classifier.in_features, self.classifier.out_features
        return linear_specs("pre_classifier", f"{param}.pre_classifier", h, h, True) + linear_specs(
            "classifier", f"{param}.classifier", n, h, True
        )


class ElectraClassifier(RobertaClassifier):
    """ELECTRA: RoBERTa's head and tensor names on the first token, with GELU (the erf form,
    as transformers' ElectraClassificationHead) in place of tanh."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(F.gelu(_linear(x, self.dense)), self.out_proj)


class DebertaClassifier(ScoreHeadModule):
    """DeBERTa-v2: ``pooler.dense`` + the config's ``pooler_hidden_act`` on the first token
    (transformers' ContextPooler), then ``classifier``. Built by models/deberta.py, which knows
    the activation."""

    def __init__(self, hidden: int, num_labels: int, *, activation: str) -> None:
        super().__init__()
        self.pooler = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, num_labels)
        self.activation = get_activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self.activation(_linear(x, self.pooler)), self.classifier)

    def weight_specs(self, param: str) -> list[WeightSpec]:
        h, n = self.pooler.in_features, self.classifier.out_features
        return linear_specs("pooler.dense", f"{param}.pooler", h, h, True) + linear_specs(
            "classifier", f"{param}.classifier", n, h, True
        )


class TokenClassifier(ScoreHeadModule):
    """``*ForTokenClassification``: ``classifier`` (with bias) on every token's final hidden
    state."""

    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.classifier = nn.Linear(hidden, num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.classifier)

    def weight_specs(self, param: str) -> list[WeightSpec]:
        h, n = self.classifier.in_features, self.classifier.out_features
        return linear_specs("classifier", f"{param}.classifier", n, h, True)


class LinearScore(ScoreHeadModule):
    """Decoders' ``score``: one linear layer without bias on the last token."""

    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.score = nn.Linear(hidden, num_labels, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.score)

    def weight_specs(self, param: str) -> list[WeightSpec]:
        h, n = self.score.in_features, self.score.out_features
        return linear_specs("score", f"{param}.score", n, h, False)


class YesNoScore(ScoreHeadModule):
    """Qwen3-Reranker: the LM head's "yes" and "no" rows; logit(yes) - logit(no), one column.

    Both logits are computed in float32 and then subtracted (not one difference row), as the
    model card computes them from the full logits."""

    def __init__(self, hidden: int, head: ClassifierHead, vocab_size: int) -> None:
        super().__init__()
        self.source, self.token_rows, self.vocab_size = head.rows_from, head.token_rows, vocab_size
        self.rows = nn.Parameter(torch.empty(len(head.token_rows), hidden))  # [yes, no]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.rows.float())  # [n, 2]
        return (logits[:, 0] - logits[:, 1]).unsqueeze(1)

    def weight_specs(self, param: str) -> list[WeightSpec]:
        shape = (self.vocab_size, self.rows.shape[1])
        return [WeightSpec(self.source, shape, f"{param}.rows", source_rows=self.token_rows)]


def build_score_head(head: ClassifierHead, hidden: int, vocab_size: int) -> ScoreHeadModule:
    if head.kind == "token":
        return TokenClassifier(hidden, head.num_labels)
    if head.kind == "bert":
        return BertClassifier(hidden, head.num_labels)
    if head.kind == "roberta":
        return RobertaClassifier(hidden, head.num_labels)
    if head.kind == "linear":
        return LinearScore(hidden, head.num_labels)
    if head.kind == "distilbert":
        return DistilBertClassifier(hidden, head.num_labels)
    if head.kind == "electra":
        return ElectraClassifier(hidden, head.num_labels)
    if head.kind == "modernbert":  # its switches are in the config: models/modernbert.py builds it
        raise ValueError("a ModernBERT head is built by its stage (ModernBertClassifier)")
    if head.kind == "deberta":  # its activation is in the config: models/deberta.py builds it
        raise ValueError("a DeBERTa head is built by its stage (DebertaClassifier)")
    return YesNoScore(hidden, head, vocab_size)
