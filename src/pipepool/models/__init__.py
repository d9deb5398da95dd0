"""Model families by Hugging Face architecture name.

Adding a family: a module with its config (``from_hf(hf, family, causal=...)``) and its
``StageModel``; one ``Family`` entry in ``_FAMILIES``; its architectures in ``_ARCHITECTURES``;
its model_type and any config field it refuses in ``checkpoint_math``."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..core.classifier_head import ClassifierHead
from ..core.dual_encoders import DUAL_ENCODERS, VISION_SUFFIX
from ..errors import ModelLoadError
from .base import KVLayout, StageModel, StepInputs, WeightSpec
from .bert import EncoderConfig, EncoderStage
from .colpali import ColPaliConfig, ColPaliStage, paligemma_text
from .colqwen2 import ColQwen2Config, ColQwen2Stage
from .deberta import DebertaConfig, DebertaStage
from .decoder import DecoderConfig, DecoderStage
from .encoders import RelativeConfig, RelativeEncoderStage
from .gemma import GemmaConfig, GemmaStage
from .modernbert import ModernBertConfig, ModernBertStage
from .qwen2_vl import Qwen2VLConfig, Qwen2VLStage, text_config
from .qwen3_vl import Qwen3VLConfig, Qwen3VLStage
from .t5 import T5Config, T5EncoderStage
from .tower_vision import VisionStage
from .towers import KINDS as TOWER_KINDS
from .towers import TowerConfig, TowerStage

__all__ = [
    "DUAL_ENCODERS", "VISION_SUFFIX", "Family", "KVLayout", "StageModel", "StepInputs",
    "WeightSpec", "family_of",
]  # fmt: skip


class StageClass(Protocol):
    """A family's ``StageModel`` class, built from the config its ``make_config`` returns."""

    def __call__(
        self,
        cfg: Any,
        layers: range,
        first: bool,
        last: bool,
        max_len: int,
        head: ClassifierHead | None = None,
    ) -> StageModel: ...

    def honours_key_lengths(self, cfg: Any) -> bool: ...

    def supports_int8(self, cfg: Any) -> bool: ...


@dataclass(frozen=True)
class Family:
    """How to read one family's checkpoints: which stage modules to build, how checkpoint tensor
    names map onto them, and the defaults of its kind. Whether attention is causal is the
    checkpoint's to say (``checkpoint_math.decide_causal``), not the family's: ``decoder`` only
    says whether the family *can* be causal and how its classifiers read a prompt."""

    name: str  # qwen3 | qwen2 | llama | mistral | bert | roberta | t5
    decoder: bool  # a decoder (causal unless its config says otherwise); else an encoder
    make_config: Callable[..., object]  # (hf, family name, causal=...) -> the stage's config
    stage: StageClass
    prefixes: tuple[str, ...]  # stripped from checkpoint names ("model." of *ForCausalLM)
    ignored: re.Pattern  # checkpoint tensors that are not part of the embedding model
    # Classifier head of its *ForSequenceClassification (classifier.HEAD_KINDS).
    head_kind: str
    # Old TF-converted checkpoints name LayerNorm weight/bias gamma/beta.
    gamma_beta_names: bool = False
    # The family's own default pooling where its kind's does not fit (None: the kind's).
    pooling: str | None = None
    # Whether its encoder reads token types (BERT, ELECTRA: pairs' second text is type 1);
    # the others are fed none (RoBERTa / XLM-R, MPNet, DistilBERT, decoders).
    reads_token_types: bool = False

    @property
    def default_pooling(self) -> str:
        """Without a sentence-transformers Pooling module: the family's own where it names one
        (T5 has no [CLS]: mean), else the last token of a decoder, the first ([CLS]) of an
        encoder; classifiers read the same token."""
        if self.pooling is not None:
            return self.pooling
        return "last" if self.decoder else "cls"

    def config(self, hf: dict, causal: bool):
        if causal and not self.decoder:
            raise ModelLoadError(f"the {self.name} family is an encoder; it cannot be causal")
        return self.make_config(hf, self.name, causal=causal)

    def num_layers(self, hf: dict) -> int:
        return int(hf["num_hidden_layers"])

    def vocab_size(self, hf: dict) -> int:
        return int(hf["vocab_size"])

    def honours_key_lengths(self, hf: dict, causal: bool) -> bool:
        """Whether the checkpoint's attention can key only a prefix of a prompt (key lengths:
        ColBERT's query expansion): bidirectional, and through ``attend`` in every layer."""
        return not causal and self.stage.honours_key_lengths(self.config(hf, causal))

    def supports_int8(self, hf: dict, causal: bool) -> bool:
        """Whether the checkpoint's CPU path can run its linear layers as dynamic int8
        (``EngineConfig.dtype="int8"``): BERT's block (bert, roberta, distilbert, electra)."""
        return not causal and self.stage.supports_int8(self.config(hf, causal))

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


@dataclass(frozen=True)
class T5Family(Family):
    """T5 checkpoints count their blocks in ``num_layers`` and store the (tied) token embedding
    as ``shared.weight`` (transformers' own saves) or ``encoder.embed_tokens.weight`` (the hub's
    safetensors conversions of sentence-t5 / gtr-t5): either is read as ``shared.weight``. A
    checkpoint holding both is refused by the loader (a tensor named twice), since
    transformers then embeds with ``encoder.embed_tokens.weight`` and ``shared`` may differ."""

    def num_layers(self, hf: dict) -> int:
        return int(hf.get("num_layers", 6))

    def canonical_name(self, name: str) -> str:
        return "shared.weight" if name == "encoder.embed_tokens.weight" else name


@dataclass(frozen=True)
class DistilBertFamily(Family):
    """DistilBERT's config counts its layers in ``n_layers``."""

    def num_layers(self, hf: dict) -> int:
        return int(hf["n_layers"])


@dataclass(frozen=True)
class TowerFamily(Family):
    """One tower of a dual encoder (CLIP, SigLIP: ``models/towers.py``); ``name`` is
    ``<kind>_<tower>``. Its sizes live in the config's ``<tower>_config``; the vision tower's
    architecture is the checkpoint's with ``:vision`` appended (``EngineConfig.tower``)."""

    def num_layers(self, hf: dict) -> int:
        return int(self._sub(hf)["num_hidden_layers"])

    def vocab_size(self, hf: dict) -> int:
        return int(hf.get("text_config", {}).get("vocab_size", 0))

    def _sub(self, hf: dict) -> dict:
        return hf.get(f"{self.name.split('_')[1]}_config") or {}


@dataclass(frozen=True)
class Qwen2VLFamily(Family):
    """Qwen2-VL and its relatives (``models/qwen2_vl.py``, ``models/qwen3_vl.py``): the
    decoder's sizes may sit in ``text_config``;
    checkpoint names come in transformers 5's layout (``model.language_model.``,
    ``model.visual.``; a ``*VLModel`` saved alone: ``language_model.``, ``visual.``) or the
    published one (``model.``, ``visual.``)."""

    def num_layers(self, hf: dict) -> int:
        return int(text_config(hf)["num_hidden_layers"])

    def vocab_size(self, hf: dict) -> int:
        return int(text_config(hf)["vocab_size"])

    def canonical_name(self, name: str) -> str:
        for prefix, becomes in (
            ("model.language_model.", ""), ("model.visual.", "visual."), ("model.", ""),
            ("language_model.", ""),  # a *VLModel's own save (no ``model.``)
        ):  # fmt: skip
            if name.startswith(prefix):
                return becomes + name[len(prefix) :]
        return name


@dataclass(frozen=True)
class ColQwen2Family(Qwen2VLFamily):
    """ColQwen2 (``models/colqwen2.py``): its Qwen2-VL in ``vlm_config``, its tensors under
    ``vlm.`` (transformers 5's ``vlm.language_model.`` / ``vlm.visual.``, or with a ``model.``
    between), the projection as ``embedding_proj_layer``."""

    def num_layers(self, hf: dict) -> int:
        return super().num_layers(hf.get("vlm_config") or {})

    def vocab_size(self, hf: dict) -> int:
        return super().vocab_size(hf.get("vlm_config") or {})

    def canonical_name(self, name: str) -> str:
        for prefix in ("vlm.model.", "vlm."):
            if name.startswith(prefix):
                return super().canonical_name("model." + name[len(prefix) :])
        return name


@dataclass(frozen=True)
class ColPaliFamily(Family):
    """ColPali (``models/colpali.py``): its PaliGemma in ``vlm_config``, its tensors under
    ``vlm.`` (``vlm.language_model.`` with or without a ``model.`` after it,
    ``vlm.vision_tower.`` with or without ``vision_model.``, ``vlm.multi_modal_projector.``;
    or with a ``model.`` after ``vlm.``), the projection as ``embedding_proj_layer``."""

    def num_layers(self, hf: dict) -> int:
        return int(paligemma_text(hf.get("vlm_config") or {})["num_hidden_layers"])

    def vocab_size(self, hf: dict) -> int:
        return int(paligemma_text(hf.get("vlm_config") or {})["vocab_size"])

    def canonical_name(self, name: str) -> str:
        if not name.startswith("vlm."):
            return name
        name = name[len("vlm.") :]
        name = name[len("model.") :] if name.startswith("model.") else name
        for prefix, becomes in (
            ("language_model.model.", ""), ("language_model.lm_head.", "lm_head."),
            ("language_model.", ""), ("vision_tower.vision_model.", "vision_tower."),
        ):  # fmt: skip
            if name.startswith(prefix):
                return becomes + name[len(prefix) :]
        return name


def _tower_config(hf: dict, family: str, *, causal: bool) -> TowerConfig:
    kind, tower = family.split("_")
    cfg = TowerConfig.from_hf(hf, kind, tower)
    if causal != cfg.causal:
        raise ModelLoadError(
            f"the {kind} {tower} tower's attention is "
            f"{'causal' if cfg.causal else 'bidirectional'} (as transformers computes it); "
            "attention cannot be overridden"
        )
    return cfg


def _t5_config(hf: dict, family: str, *, causal: bool) -> T5Config:
    return T5Config.from_hf(hf, family, causal=causal)


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
_FAMILIES.update(
    (name, Family(name, True, GemmaConfig.from_hf, GemmaStage, ("model.",), _DECODER_IGNORED,
                  "linear"))
    for name in ("gemma2", "gemma3")
)  # fmt: skip
_FAMILIES["bert"] = Family(
    "bert", False, _encoder_config, EncoderStage, ("bert.",), _ENCODER_IGNORED, "bert", True,
    reads_token_types=True,
)  # fmt: skip
_FAMILIES["roberta"] = Family(
    "roberta", False, _encoder_config, EncoderStage, ("roberta.",), _ENCODER_IGNORED, "roberta",
    True,
)  # fmt: skip
# ModernBertForMaskedLM's head and decoder (the MLM logits) are not part of the encoder.
_FAMILIES["modernbert"] = Family(
    "modernbert", False, ModernBertConfig.from_hf, ModernBertStage, ("model.",),
    re.compile(r"^(head\..*|decoder\..*)$"), "modernbert",
)  # fmt: skip
# T5Model / T5ForConditionalGeneration: only the encoder computes an embedding.
_FAMILIES["t5"] = T5Family(
    "t5", False, _t5_config, T5EncoderStage, (), re.compile(r"^(decoder\..*|lm_head\..*)$"),
    "none", pooling="mean",
)  # fmt: skip

# BERT's relatives (models/encoders.py); their LM and pre-training heads are not the encoder.
_FAMILIES["distilbert"] = DistilBertFamily(
    "distilbert", False, RelativeConfig.from_hf, RelativeEncoderStage, ("distilbert.",),
    re.compile(r"^(vocab_transform\..*|vocab_layer_norm\..*|vocab_projector\..*|"
               r"embeddings\.position_ids)$"),
    "distilbert", True,
)  # fmt: skip
_FAMILIES["electra"] = Family(
    "electra", False, RelativeConfig.from_hf, RelativeEncoderStage, ("electra.",),
    re.compile(r"^(discriminator_predictions\..*|embeddings\.position_ids|"
               r"embeddings\.token_type_ids)$"),
    "electra", True, reads_token_types=True,
)  # fmt: skip
# MPNetForSequenceClassification's head has RoBERTa's shape; the architecture is not registered.
_FAMILIES["mpnet"] = Family(
    "mpnet", False, RelativeConfig.from_hf, RelativeEncoderStage, ("mpnet.",),
    re.compile(r"^(pooler\..*|lm_head\..*|embeddings\.position_ids)$"), "roberta", True,
)  # fmt: skip
# DeBERTa-v2 / v3 (models/deberta.py). Its MLM heads are not the encoder; a position table
# stored while position_biased_input is false is never read (transformers drops it on load).
_FAMILIES["deberta"] = Family(
    "deberta", False, DebertaConfig.from_hf, DebertaStage, ("deberta.",),
    re.compile(r"^(cls\..*|lm_predictions\..*|mask_predictions\..*|embeddings\.position_ids|"
               r"embeddings\.position_embeddings\.weight)$"),
    "deberta", reads_token_types=True,
)  # fmt: skip

# Dual encoders (models/towers.py): each tower a family; the checkpoint's other tower's tensors
# and the contrastive logit scale and bias are not part of it.
for _kind in TOWER_KINDS:
    _text, _vision = f"{_kind}_text", f"{_kind}_vision"
    _FAMILIES[_text] = TowerFamily(
        _text, _kind == "clip", _tower_config, TowerStage, (),
        re.compile(r"^(vision_model\..*|visual_projection\..*|logit_scale|logit_bias|"
                   r"text_model\.embeddings\.position_ids)$"),
        "none", pooling="last",
    )  # fmt: skip
    _FAMILIES[_vision] = TowerFamily(
        _vision, False, _tower_config, VisionStage, (),
        re.compile(r"^(text_model\..*|text_projection\..*|logit_scale|logit_bias|"
                   r"vision_model\.embeddings\.position_ids)$"),
        "none", pooling="cls",
    )  # fmt: skip

for _vl in ("qwen2_vl", "qwen2_5_vl"):
    _FAMILIES[_vl] = Qwen2VLFamily(
        _vl, True, Qwen2VLConfig.from_hf, Qwen2VLStage, (), re.compile(r"^lm_head\..*$"), "none"
    )

_FAMILIES["qwen3_vl"] = Qwen2VLFamily(
    "qwen3_vl", True, Qwen3VLConfig.from_hf, Qwen3VLStage, (), re.compile(r"^lm_head\..*$"),
    "none",
)  # fmt: skip

# ColQwen2 (models/colqwen2.py): one vector per token, MaxSim.
_FAMILIES["colqwen2"] = ColQwen2Family(
    "colqwen2", True, ColQwen2Config.from_hf, ColQwen2Stage, (), re.compile(r"^lm_head\..*$"),
    "none", pooling="all",
)  # fmt: skip

# ColPali (models/colpali.py): bidirectional over the whole prompt, one vector per token. The
# SigLIP tower's pooling head is not PaliGemma's (it reads the tower's last hidden state).
_FAMILIES["colpali"] = ColPaliFamily(
    "colpali", False, ColPaliConfig.from_hf, ColPaliStage, (),
    re.compile(r"^(lm_head\..*|vision_tower\.head\..*)$"), "none", pooling="all",
)  # fmt: skip

_ARCHITECTURES = {
    "ColQwen2ForRetrieval": "colqwen2",
    "ColPaliForRetrieval": "colpali",
    # Vision-language embedders (models/qwen2_vl.py): the last token's hidden state.
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2VLModel": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen2_5_VLModel": "qwen2_5_vl",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",  # models/qwen3_vl.py
    "Qwen3VLModel": "qwen3_vl",
    "CLIPModel": "clip_text",
    "CLIPModel:vision": "clip_vision",
    "SiglipModel": "siglip_text",
    "SiglipModel:vision": "siglip_vision",
    "Siglip2Model": "siglip2_text",
    "Siglip2Model:vision": "siglip2_vision",
    # Token classifiers (NER): the encoder plus ``classifier`` on every token.
    "BertForTokenClassification": "bert",
    "RobertaForTokenClassification": "roberta",
    "XLMRobertaForTokenClassification": "roberta",
    "DistilBertForTokenClassification": "distilbert",
    "ElectraForTokenClassification": "electra",
    "DebertaV2ForTokenClassification": "deberta",
    "ModernBertForTokenClassification": "modernbert",  # head + classifier on every token
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
    "T5EncoderModel": "t5",
    "T5Model": "t5",
    "T5ForConditionalGeneration": "t5",
    "ModernBertModel": "modernbert",
    "ModernBertForMaskedLM": "modernbert",
    "DistilBertModel": "distilbert",
    "DistilBertForMaskedLM": "distilbert",
    "ElectraModel": "electra",
    "ElectraForPreTraining": "electra",
    "MPNetModel": "mpnet",
    "MPNetForMaskedLM": "mpnet",
    # Classifiers (cross-encoders, rerankers): the same stages plus a head (score_heads.py).
    "BertForSequenceClassification": "bert",
    "RobertaForSequenceClassification": "roberta",
    "XLMRobertaForSequenceClassification": "roberta",
    "ModernBertForSequenceClassification": "modernbert",
    "DistilBertForSequenceClassification": "distilbert",
    "ElectraForSequenceClassification": "electra",
    "Qwen3ForSequenceClassification": "qwen3",
    "Qwen2ForSequenceClassification": "qwen2",
    "LlamaForSequenceClassification": "llama",
    "MistralForSequenceClassification": "mistral",
    "Gemma2Model": "gemma2",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma2ForSequenceClassification": "gemma2",
    # Gemma3 text only (model_type gemma3_text): EmbeddingGemma, Gemma3ForCausalLM.
    "Gemma3TextModel": "gemma3",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3TextForSequenceClassification": "gemma3",
    "DebertaV2Model": "deberta",
    "DebertaV2ForMaskedLM": "deberta",
    "DebertaV2ForSequenceClassification": "deberta",
}


def family_of(architecture: str) -> Family:
    try:
        return _FAMILIES[_ARCHITECTURES[architecture]]
    except KeyError:
        raise ModelLoadError(
            f"unknown architecture {architecture!r}; supported: {', '.join(sorted(_ARCHITECTURES))}"
        ) from None
