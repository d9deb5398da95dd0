"""What every model family provides to the runner and the weight loader."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..layers import triton_attention
from ..layers.attention import AttentionMetadata, AttentionShape
from ..runtime.user_cache import cache_dir

if TYPE_CHECKING:
    from ..core.plan import StepPlan


@dataclass(frozen=True)
class WeightSpec:
    """One checkpoint tensor and where it goes.

    ``rows`` is the slice of the parameter's first dimension that the tensor fills, for
    projections we fuse (q|k|v, gate|up); None means the whole parameter.
    """

    checkpoint_name: str  # canonical name (family prefix stripped, gamma/beta renamed)
    shape: tuple[int, ...]
    param: str  # name in this stage module's state_dict
    rows: tuple[int, int] | None = None
    # Rows of the checkpoint tensor to read, in this order, when the parameter keeps only a
    # few (the "yes" and "no" rows of an LM head); None: the whole tensor.
    source_rows: tuple[int, ...] | None = None


@dataclass
class StepInputs:
    """Per-step model inputs besides the hidden states (built by the runner, on device)."""

    positions: torch.Tensor  # [T] int64 absolute position of each token in its prompt
    attn: AttentionMetadata
    # [T] int64 token type (segment) of each token: pair inputs of encoders (cross-encoders)
    # on the first stage; None: type 0 throughout. Decoders have no token types.
    token_type_ids: torch.Tensor | None = None
    # [k] int64 rows of the step whose final hidden states are read (the pooler's picks: the
    # last token of each finished LAST request, the first of a CLS one), on the last stage of
    # a model that ``keeps_rows``; its forward then returns those k rows, in this order, and
    # computes the last layer's work after attention for them alone (attention itself, and so
    # the KV cache, for every row). None: every row.
    keep_rows: torch.Tensor | None = None
    # Vision-language models (``core/media.py``): [T, 4] int64 each token's M-RoPE position
    # (t, h, w) and image feature row (1-based; 0: text), on every stage; None: 1-D positions.
    media: torch.Tensor | None = None
    # The first stage's image placeholder rows of the step ([k, hidden]), in step order: the
    # vision tower's features that replace those tokens' embeddings; None: no image token.
    image_embeds: torch.Tensor | None = None


def kept_rows(
    x: torch.Tensor, attn_out: torch.Tensor, keep: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows ``keep`` of a layer's residual stream and attention output (all, when None):
    every operation after attention is row-wise, so the last layer computes it for the rows
    the pooler reads only (``StepInputs.keep_rows``)."""
    if keep is None:
        return x, attn_out
    return x.index_select(0, keep), attn_out.index_select(0, keep)


@dataclass(frozen=True)
class KVLayout:
    """Shape of one layer's cache rows: [slots, num_kv_heads, head_dim]."""

    num_kv_heads: int
    head_dim: int


def kv_bytes_per_token(layout: KVLayout, num_layers: int, dtype: torch.dtype) -> int:
    """Bytes of K and V one token takes over ``num_layers`` layers of this layout."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * layout.num_kv_heads * layout.head_dim * itemsize


class ScoreHeadModule(nn.Module):
    """A classifier's head (models/score_heads.py): pooled rows ``[n, hidden]`` in, logits
    ``[n, num_labels]`` out; ``weight_specs`` names its checkpoint tensors under ``param``."""

    def weight_specs(self, param: str) -> list[WeightSpec]:
        raise NotImplementedError


class StageModel(nn.Module):
    """A contiguous slice of a model's layers; the first stage embeds, the last normalises.

    ``forward(x, inputs, kv_caches)``: x is token ids [T] on the first stage, else hidden
    states [T, hidden]; returns hidden states [T, hidden] (final-normed on the last stage).
    """

    causal: bool  # causal models chunk prompts and keep a KV cache; encoders do neither
    hidden_size: int
    num_layers: int  # in the whole model
    max_positions: int  # the model's own limit (position table / RoPE range)
    kv_layout: KVLayout | None  # None for encoders
    attention_shape: AttentionShape  # what the attention kernel is chosen and checked for
    attn_kernel: str  # the deployment's choice (layers/attention.py)
    # Whether the forward can be captured as CUDA graphs (cut at every ``attend()`` call):
    # False where some attention of the model reads the step's offsets on the host (additive
    # position bias, soft-capping, symmetric windows), so the deployment runs it eagerly.
    graph_safe: bool = True
    # Whether the forward honours ``StepInputs.keep_rows`` (a last stage returning only the
    # rows its pooler reads).
    keeps_rows: bool = False
    # Whether the family has layer bodies to torch.compile (``set_compiled``); without, the
    # deployment runs it eagerly and refuses compile=True by name.
    compiles: bool = True
    # Whether the model pools as its checkpoint does and no other way (a dual encoder's towers:
    # the EOS, the class token, an attention head), so EngineConfig.pooling is refused.
    fixed_pooling: bool = False
    # The token whose embedding image features replace, on the first stage of a
    # vision-language model (which then has ``encode_images``); None elsewhere.
    image_token_id: int | None = None

    def __init__(self, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.layer_range, self.is_first, self.is_last = layers, first, last
        # A classifier's head on the last stage (models/score_heads.py), applied to the pooled
        # rows by the stage's pooler; None for embedding models and other stages.
        self.score_head: ScoreHeadModule | None = None

    def weight_specs(self) -> list[WeightSpec]:
        raise NotImplementedError

    def encode_images(self, images: list) -> torch.Tensor:
        """The vision tower's feature rows of ``images`` (``core/media.ImageInput``), in order:
        the first stage of a vision-language model (``image_token_id`` set)."""
        raise NotImplementedError(f"{type(self).__name__} has no vision tower")

    def received_rows(self, plan: StepPlan) -> int:
        """Rows the previous stage sends this one for ``plan``: its hidden states, one a token
        (Qwen3-VL's DeepStack rows follow them, ``models/qwen3_vl.py``)."""
        return plan.num_tokens

    @property
    def output_size(self) -> int:
        """Width of the last stage's rows: ``hidden_size``, unless the last stage projects
        (a dual encoder's towers)."""
        return self.hidden_size

    @classmethod
    def honours_key_lengths(cls, cfg: Any) -> bool:
        """Whether every attention of a model of this family config (``Family.config``) can
        key only a prefix of a prompt (``AttentionMetadata.key_rows``, ColBERT's query
        expansion): attention through ``attend`` on whole bidirectional prompts. Families whose
        layers add position biases or windows of their own to the scores say no."""
        return False

    @classmethod
    def supports_int8(cls, cfg: Any) -> bool:
        """Whether this family's CPU path can run its linear layers as dynamic int8
        (``EngineConfig.dtype="int8"``; ``quantize_int8``)."""
        return False

    def quantize_int8(self) -> None:
        """Pack the layers' projections as int8 and run them so from the next forward on."""
        raise NotImplementedError(f"{type(self).__name__} has no int8 path")

    def graph_safe_with(self, kernel: str) -> bool:
        """Whether the forward can be captured as CUDA graphs when its attention runs
        ``kernel`` (the deployment's choice): ``graph_safe``, or more where a family's own
        attention runs inside the Triton kernel."""
        return self.graph_safe

    def attention_block_rows(self) -> int | None:
        """The Triton attention kernel's BLOCK_M where this model runs it from a work list (an
        encoder: its steps carry the list, which lets a CUDA graph hold its whole forward),
        else None. Causal steps launch a grid from the step: faster there
        (docs/benchmarks/gpu-short-inputs.md)."""
        if self.attn_kernel != "triton" or self.causal:
            return None
        return triton_attention.block_rows(self.attention_shape.head_dim)

    def head_specs(self) -> list[WeightSpec]:
        """The score head's checkpoint tensors (none without one)."""
        return self.score_head.weight_specs("score_head") if self.score_head is not None else []

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers after the module left the meta device."""

    def set_compiled(self, on: bool) -> None:
        """Run the layer bodies through torch.compile (one graph shared by all layers)."""

    def layer_body(self) -> object:
        """What ``set_compiled`` switches (the functions around attention), to hand from one
        copy of the model to another (``stage/background_compile.py``)."""
        return None

    def use_layer_body(self, body: object) -> None:
        """Run ``body`` (another copy's ``layer_body()``) from the next forward on."""

    def has_fused_kernels(self) -> bool:
        """Whether this family has fused Triton kernels in its layer body (q/k-norm + RoPE,
        Gemma's GeGLU)."""
        return False

    def use_fused_kernels(self) -> bool:
        """Use this family's fused kernels where each agrees with the eager ops on this stage's
        weights; returns whether all of them are in use (else the stage warns)."""
        return False


def linear_specs(
    prefix_ckpt: str, param: str, out_dim: int, in_dim: int, bias: bool, rows=None
) -> list[WeightSpec]:
    """Weight (and bias) specs of one ``nn.Linear`` checkpoint entry."""
    specs = [WeightSpec(f"{prefix_ckpt}.weight", (out_dim, in_dim), f"{param}.weight", rows)]
    if bias:
        specs.append(WeightSpec(f"{prefix_ckpt}.bias", (out_dim,), f"{param}.bias", rows))
    return specs


def compile_layer_fn(fn, *, round_like_eager: bool):
    """torch.compile for a layer-body function, dynamic in the number of tokens.

    ``round_like_eager``: round to bf16/fp16 wherever eager does (inductor's
    ``emulate_precision_casts``), so compiled vectors equal eager ones. The decoders need it:
    without it a per-token ALL output fell to cosine 0.99878 against fp32 on the GPU
    (docs/benchmarks/gpu-short-inputs.md). It costs: the all-MiniLM-L6-v2 shape ran W1 at 2.16M
    tokens/s with it and 2.83M without (one H200, same call), so encoders, whose compiled parts
    (embeddings; output projection, residual, LayerNorm, MLP) only gain precision from fewer
    roundings, go without.

    Compiled kernels are cached in the user's cache directory (``PIPEPOOL_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/pipepool`` or ``~/.cache/pipepool``), not in /tmp, so they survive reboots
    and the next start reuses them; ``TORCHINDUCTOR_CACHE_DIR`` set by the user wins."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_dir(), "inductor"))
    import torch._inductor.config as inductor_config

    options: dict[str, str | int | bool | Callable[..., Any]] = {}  # torch.compile's type
    if hasattr(inductor_config, "emulate_precision_casts"):
        options["emulate_precision_casts"] = round_like_eager
    return torch.compile(fn, dynamic=True, options=options)


def embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """An ``nn.Embedding`` without its random initialisation: models are built on the meta
    device and filled from the checkpoint, and ``normal_`` on a meta tensor goes through
    ``torch._refs``, whose first call imports ``torch._dynamo`` (about 2 s of every start)."""
    return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))
