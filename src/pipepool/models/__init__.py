"""Model families by Hugging Face architecture name.

Adding a family: a module with its config (``from_hf(hf, family, causal=...)``) and its
``StageModel``; one ``Family`` entry in ``_FAMILIES``; its architectures in ``_ARCHITECTURES``;
its model_type and any config field it refuses in ``checkpoint_math``."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ..classifier import ClassifierHead
from ..errors import ModelLoadError
from .base import KVLayout, StageModel, StepInputs, WeightSpec
from .bert import EncoderConfig, EncoderStage
from .decoder import DecoderConfig, DecoderStage

__all__ = ["Family", "KVLayout", "StageModel", "StepInputs", "WeightSpec", "family_of"]


@dataclass(frozen=True)
class Family:
    """How to read one family's checkpoints: which stage modules to build, how checkpoint tensor
    names map onto them, and the defaults of its kind. Whether attention is causal is the
    checkpoint's to say (``checkpoint_math.decide_causal``), not the family's: ``decoder`` only
    says whether the family *can* be causal and how its classifiers read a prompt."""

    name: str  # qwen3 | qwen2 | llama | mistral | bert | roberta
    decoder: bool  # a decoder (causal unless its config says otherwise); else an encoder
    make_config: Callable[..., object]  # (hf, family name, causal=...) -> the stage's config
    stage: type[StageModel]
    prefixes: tuple[str, ...]  # stripped from checkpoint names ("model." of *ForCausalLM)
    ignored: re.Pattern  # checkpoint tensors that are not part of the embedding model
    # Classifier head of its *ForSequenceClassification (classifier.HEAD_KINDS).
    head_kind: str
    # Old TF-converted checkpoints name LayerNorm weight/bias gamma/beta.
    gamma_beta_names: bool = False

    @property
    def default_pooling(self) -> str:
        """Without a sentence-transformers Pooling module: the last token of a decoder, the
        first ([CLS]) of an encoder; classifiers read the same token."""
        return "last" if self.decoder else "cls"

    def config(self, hf: dict, causal: bool):
        if causal and not self.decoder:
            raise ModelLoadError(f"the {self.name} family is an encoder; it cannot be causal")
        return self.make_config(hf, self.name, causal=causal)

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
        *,
        causal: bool,
    ) -> StageModel:
        """A stage's modules; ``head``: a classifier's head, built on the last stage;
        ``causal``: the attention the deployment decided for this checkpoint."""
        return self.stage(self.config(hf, causal), layers, first, last, max_len, head)

    def canonical_name(self, name: str) -> str:
        for prefix in self.prefixes:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        if self.gamma_beta_names:
            name = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", name)
            name = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name)
        return name


def _encoder_config(hf: dict, family: str, *, causal: bool) -> EncoderConfig:
    assert not causal
    return EncoderConfig.from_hf(hf, family)


_DECODER_IGNORED = re.compile(r"^(lm_head\..*|.*rotary_emb\.inv_freq)$")
_ENCODER_IGNORED = re.compile(
    r"^(pooler\..*|cls\..*|lm_head\..*|embeddings\.position_ids|embeddings\.token_type_ids)$"
)

_FAMILIES = {
    name: Family(
        name, True, DecoderConfig.from_hf, DecoderStage, ("model.",), _DECODER_IGNORED, "linear"
    )
    for name in ("qwen3", "qwen2", "llama", "mistral")
}
_FAMILIES["bert"] = Family(
    "bert", False, _encoder_config, EncoderStage, ("bert.",), _ENCODER_IGNORED, "bert", True
)
_FAMILIES["roberta"] = Family(
    "roberta", False, _encoder_config, EncoderStage, ("roberta.",), _ENCODER_IGNORED, "roberta",
    True,
)  # fmt: skip

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
