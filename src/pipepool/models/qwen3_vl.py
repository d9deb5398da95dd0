"""Qwen3-VL as an embedding model (Qwen3-VL-Embedding and other embedders built on it):
transformers' ``Qwen3VLModel`` / ``Qwen3VLForConditionalGeneration``, the last token's final
hidden state. Qwen2-VL's pipeline (``qwen2_vl.py``: inputs, media rows, image rows on the first
stage) with three differences in the math:

- the decoder is Qwen3's (q and k RMS-normed per head before RoPE);
- M-RoPE is interleaved: rotary component j turns by the height position when ``j % 3 == 1``
  and ``j < 3 * mrope_section[1]``, by the width position when ``j % 3 == 2`` and
  ``j < 3 * mrope_section[2]``, else by the temporal one (transformers'
  ``Qwen3VLTextRotaryEmbedding.recomposition_frequencies``);
- DeepStack: decoder layer i < ``deepstack`` (the vision tower's DeepStack mergers,
  ``qwen3_vl_vision.py``) adds the i-th DeepStack row of each image token to that token's
  output. The first stage reads them with the merger's rows (``StepInputs.image_embeds``: one
  row a placeholder token, chosen by the plan's feature rows, however the step cut through the
  image); a stage whose successor holds DeepStack layers sends their rows on after its hidden
  states, ``[image tokens of the step x layers to go, hidden]`` in step order
  (``received_rows`` gives the count from the plan, so the receiver knows the message's size,
  and a stage that receives another count stops before computing)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..core.classifier_head import ClassifierHead
from ..core.media import FEATURE_ROW
from ..core.plan import StepPlan
from ..errors import ModelLoadError
from .base import StepInputs
from .decoder import DecoderConfig
from .qwen2_vl import ImageTower, Qwen2VLStage, text_config, vl_parts
from .qwen3_vl_vision import Qwen3VisionConfig, Qwen3VisionTower

_DEFAULT_SECTION = (24, 20, 20)  # transformers' Qwen3-VL default
_DEFAULT_THETA = 500000.0  # Qwen3VLTextConfig.default_theta
# transformers' Qwen3-VL text model attends over the whole prompt in every layer whatever these
# say (it has no sliding window): they are not passed on to the decoder's config.
_UNREAD = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")


@dataclass(frozen=True)
class Qwen3VLConfig:
    """A Qwen3-VL config.json: the decoder, the vision tower, the M-RoPE sections, the image
    placeholder token and how many decoder layers add DeepStack rows."""

    text: DecoderConfig
    vision: Qwen3VisionConfig
    mrope_section: tuple[int, ...]
    image_token_id: int

    @property
    def deepstack(self) -> int:
        """Decoder layers 0..deepstack-1 add DeepStack rows (transformers adds the i-th set of
        rows after layer i, for as many sets as the tower makes and layers there are)."""
        return min(len(self.vision.deepstack), self.text.num_layers)

    @classmethod
    def from_hf(cls, hf: dict, family: str, *, causal: bool = True) -> Qwen3VLConfig:
        if not causal:
            raise ModelLoadError("Qwen3-VL's decoder is causal; bidirectional is not implemented")
        text = text_config(hf)
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ModelLoadError(f"Qwen3-VL rope type {kind!r} is not implemented (M-RoPE)")
        if rope.get("mrope_interleaved", True) is not True:
            raise ModelLoadError(
                f"text_config mrope_interleaved={rope['mrope_interleaved']!r}: transformers' "
                "Qwen3-VL interleaves M-RoPE's axes whatever it says; refusing a checkpoint that "
                "asks otherwise"
            )
        decoder, section, vision, image_token = vl_parts(
            hf, text, rope, "Qwen3-VL", "qwen3", _DEFAULT_SECTION, _DEFAULT_THETA,
            ("rope_scaling", *_UNREAD),
        )  # fmt: skip
        vision_cfg = Qwen3VisionConfig.from_hf(vision, decoder.hidden_size)
        return cls(decoder, vision_cfg, section, image_token)


def interleaved_axes(section: tuple[int, ...]) -> torch.Tensor:
    """The position axis (t, h, w) each component of the cos|sin table turns by, interleaved
    as transformers' Qwen3-VL composes them."""
    half = sum(section)
    axes = [0] * half
    for axis in (1, 2):
        for j in range(axis, min(3 * section[axis], half), 3):
            axes[j] = axis
    return torch.tensor(axes + axes, dtype=torch.int64)


class Qwen3VLStage(Qwen2VLStage):
    """A slice of Qwen3-VL's decoder; the first stage holds the vision tower, and every stage
    whose layers or successors' layers add DeepStack rows passes them on (module doc)."""

    def __init__(
        self,
        cfg: Qwen3VLConfig,
        layers: range,
        first: bool,
        last: bool,
        max_len: int,
        head: ClassifierHead | None = None,
    ) -> None:
        self.vl3 = cfg  # before the base's __init__, which builds the tower (vision_tower)
        # The base reads .text and .image_token_id of it; the rest through the hooks below.
        super().__init__(cfg, layers, first, last, max_len, head)  # type: ignore[arg-type]
        deepstack = cfg.deepstack
        # DeepStack rows per image token that arrive with the hidden states, and that go on.
        self.stack_in = 0 if first else max(0, deepstack - layers.start)
        self.stack_out = 0 if last else max(0, deepstack - layers.stop)
        if last and layers.stop - 1 < deepstack:
            self.keeps_rows = False  # the last layer adds rows at image tokens: all rows on

    def vision_tower(self) -> ImageTower:
        return Qwen3VisionTower(self.vl3.vision)

    def rope_axes(self) -> torch.Tensor:
        return interleaved_axes(self.vl3.mrope_section)

    def received_rows(self, plan: StepPlan) -> int:
        if not self.stack_in or not len(plan.media):
            return plan.num_tokens
        images = int((plan.media[:, FEATURE_ROW] > 0).sum())
        return plan.num_tokens + images * self.stack_in

    def forward(self, x: torch.Tensor, inputs: StepInputs, kv_caches) -> torch.Tensor:
        h, tokens, media = self.hidden_size, len(inputs.positions), inputs.media
        stacked = None  # [image tokens, DeepStack layers from this stage's first on, hidden]
        if self.is_first:
            x = self.embed_tokens(x)
            if inputs.image_embeds is not None:
                assert media is not None, "image rows come with media rows"
                rows = inputs.image_embeds.to(x.dtype)
                x = x.clone()
                x[media[:, FEATURE_ROW] > 0] = rows[:, :h]
                stacked = rows[:, h : h * (1 + self.vl3.deepstack)].reshape(len(rows), -1, h)
        elif self.stack_in:
            stacked = x[tokens:].view(-1, self.stack_in, h)
            x = x[:tokens]
        image = None
        if stacked is not None and len(stacked):
            assert media is not None, "DeepStack rows come with media rows"
            image = torch.nonzero(media[:, FEATURE_ROW] > 0).squeeze(1)
        cos_sin = self.rotary.cos_sin
        if media is not None:  # each token's own row of the table (qwen2_vl.py)
            cos_sin = cos_sin.gather(0, media[:, self.axes])
            inputs = replace(inputs, positions=torch.arange(tokens, device=media.device))
        last, start = len(self.layers) - 1, self.layer_range.start
        for j, layer in enumerate(self.layers.values()):
            kv = kv_caches[j] if kv_caches is not None else None
            keep = inputs.keep_rows if self.is_last and j == last else None
            x = layer(x, inputs, kv, cos_sin, self.ops, self.attn_kernel, keep)
            if image is not None and stacked is not None and start + j < self.vl3.deepstack:
                x = x.index_add(0, image, stacked[:, j])
        if self.is_last:
            return self.norm(x)
        if self.stack_out and image is not None and stacked is not None:
            onward = stacked[:, self.layer_range.stop - start :]
            x = torch.cat([x, onward.reshape(-1, h)])
        return x
