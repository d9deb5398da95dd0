"""Model families by Hugging Face architecture name."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..classifier import ClassifierHead
from ..errors import ModelLoadError
from .base import KVLayout, StageModel, StepInputs, WeightSpec
from .bert import EncoderConfig, EncoderStage
from .decoder import DecoderConfig, DecoderStage

__all__ = ["Family", "KVLayout", "StageModel", "StepInputs", "WeightSpec", "family_of"]


@dataclass(frozen=True)
class Family:
    """How to read one family's checkpoints."""

    name: str  # qwen3 | qwen2 | llama | mistral | bert | roberta
    causal: bool
    prefixes: tuple[str, ...]  # stripped from checkpoint names ("model." of *ForCausalLM)
    ignored: re.Pattern  # checkpoint tensors that are not part of the embedding model

    def config(self, hf: dict):
        if self.causal:
            return DecoderConfig.from_hf(hf, self.name)
        return EncoderConfig.from_hf(hf, self.name)

    def num_layers(self, hf: dict) -> int:
        return int(hf["num_hidden_layers"])

    def build(
        self,
        hf: dict,
        layers: range,
        first: bool,
        last: bool,
        max_len: int,
        head: ClassifierHead | None = None,
    ) -> StageModel:
        """A stage's modules; ``head``: a classifier's head, built on the last stage."""
        stage_cls = DecoderStage if self.causal else EncoderStage
        return stage_cls(self.config(hf), layers, first, last, max_len, head)

    def canonical_name(self, name: str) -> str:
        for prefix in self.prefixes:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        if not self.causal:  # old BERT checkpoints (TF conversions) name LayerNorm gamma/beta
            name = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", name)
            name = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name)
        return name


_DECODER_IGNORED = re.compile(r"^(lm_head\..*|.*rotary_emb\.inv_freq)$")
_ENCODER_IGNORED = re.compile(
    r"^(pooler\..*|cls\..*|lm_head\..*|embeddings\.position_ids|embeddings\.token_type_ids)$"
)

_FAMILIES = {
    name: Family(name, True, ("model.",), _DECODER_IGNORED)
    for name in ("qwen3", "qwen2", "llama", "mistral")
}
_FAMILIES["bert"] = Family("bert", False, ("bert.",), _ENCODER_IGNORED)
_FAMILIES["roberta"] = Family("roberta", False, ("roberta.",), _ENCODER_IGNORED)

_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3Model": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2Model": "qwen2",
    "LlamaForCausalLM": "llama",
    "LlamaModel": "llama",
    "MistralForCausalLM": "mistral",
    "MistralModel": "mistral",
    "BertModel": "bert",
    "BertForMaskedLM": "bert",
    "BertForPreTraining": "bert",
    "RobertaModel": "roberta",
    "RobertaForMaskedLM": "roberta",
    "XLMRobertaModel": "roberta",
    "XLMRobertaForMaskedLM": "roberta",
    # Classifiers (cross-encoders, rerankers): the same stages plus a head (score_heads.py).
    "BertForSequenceClassification": "bert",
    "RobertaForSequenceClassification": "roberta",
    "XLMRobertaForSequenceClassification": "roberta",
    "Qwen3ForSequenceClassification": "qwen3",
    "Qwen2ForSequenceClassification": "qwen2",
    "LlamaForSequenceClassification": "llama",
    "MistralForSequenceClassification": "mistral",
}


def family_of(architecture: str) -> Family:
    try:
        return _FAMILIES[_ARCHITECTURES[architecture]]
    except KeyError:
        raise ModelLoadError(
            f"unknown architecture {architecture!r}; supported: {', '.join(sorted(_ARCHITECTURES))}"
        ) from None
