"""Retrieval heads of the last stage (``loading/retrieval.py`` says which a model has), over a
step's final hidden states on the device:

- ``SpladeTransform``: every token's masked-LM logits through ``log1p(relu(.))``; the pooler
  takes their max or sum over each prompt (``Pooler``), a block of rows at a time so that a
  step never holds ``[tokens, vocabulary]`` logits at once.
- ``M3TokenHead``: BGE-M3's lexical weight and ColBERT vector of every token, and its dense
  vector on each prompt's first row, packed into one row per token (``M3Layout``).
- ``ColbertTokenHead``: PyLate's Dense projections of every token (normalised by the usual
  heads afterwards).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.activation import get_activation
from ..loading.model_folder import ModelFolder
from ..loading.retrieval import ColbertHead, M3Head, M3Layout, RetrievalHead, SpladeHead
from ..loading.weights import Checkpoint, load_pt_linear
from ..models import family_of
from .heads import DenseHead, l2_normalize

# Rows of a step whose vocabulary-wide logits exist at once (SpladeTransform.pool_rows): 4096 x
# 30522 float32 is 0.5 GB.
_SPLADE_BLOCK_ROWS = 4096


class SpladeTransform(nn.Module):
    """A SparseEncoder's per-token activations: ``log1p(relu(decoder(norm(act(dense(h))))))``
    (``log1p`` twice for the ``log1p_relu`` variant). The matmuls run in the stage's dtype, as
    the model's own MLM head would; the activations in float32."""

    def __init__(self, head: SpladeHead, folder: ModelFolder, dtype: torch.dtype) -> None:
        super().__init__()
        checkpoint = Checkpoint(folder.path, family_of(folder.architecture))
        tensors = {role: checkpoint.read(name).to(dtype) for role, name in head.tensors}
        checkpoint.close()
        self.dense_weight = nn.Parameter(tensors["dense.weight"], requires_grad=False)
        self.dense_bias = nn.Parameter(tensors["dense.bias"], requires_grad=False)
        self.norm_weight = nn.Parameter(tensors["norm.weight"], requires_grad=False)
        self.norm_bias = nn.Parameter(tensors["norm.bias"], requires_grad=False)
        self.decoder_weight = nn.Parameter(tensors["decoder.weight"], requires_grad=False)
        self.decoder_bias = nn.Parameter(tensors["decoder.bias"], requires_grad=False)
        self.act = get_activation(head.activation)
        self.eps = head.eps
        self.twice = head.splade_activation == "log1p_relu"
        self.vocab_size = head.vocab_size

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[n, hidden] (any float dtype) -> [n, vocab] float32, every value >= 0."""
        h = h.to(self.dense_weight.dtype)
        x = self.act(F.linear(h, self.dense_weight, self.dense_bias))
        x = F.layer_norm(x, (x.shape[-1],), self.norm_weight, self.norm_bias, self.eps)
        logits = F.linear(x, self.decoder_weight, self.decoder_bias).float()
        out = torch.log1p(torch.relu(logits))
        return torch.log1p(out) if self.twice else out

    def pool_rows(
        self,
        hidden: torch.Tensor,
        seg: torch.Tensor,
        slots: int,
        how: str,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[slots, vocab]: the max ("amax") or sum ("sum") of the activations of the rows of
        ``hidden`` in each slot (``seg``: each row's slot; rows of slot ``slots - 1`` or above
        belong to none), a block of rows at a time; ``weights``: per-row factors of a sum."""
        out = hidden.new_zeros((slots, self.vocab_size), dtype=torch.float32)
        for a in range(0, hidden.shape[0], _SPLADE_BLOCK_ROWS):
            b = min(a + _SPLADE_BLOCK_ROWS, hidden.shape[0])
            x = self(hidden[a:b])
            if weights is not None:
                x = x * weights[a:b].unsqueeze(1)
            index = seg[a:b]
            if how == "amax":
                # Activations are >= 0, so the zeros the sums start from are the max's identity.
                out.scatter_reduce_(0, index.unsqueeze(1).expand(-1, x.shape[1]), x, "amax")
            else:
                out.index_add_(0, index, x)
        return out


class M3TokenHead(nn.Module):
    """BGE-M3's heads over the token rows of whole prompts (float32, as FlagEmbedding computes
    on the CPU): ``relu(sparse_linear(h))`` and ``normalize(colbert_linear(h))`` per token, the
    [CLS] row (normalised where the request asks) as the dense vector."""

    def __init__(self, head: M3Head, hidden: int) -> None:
        super().__init__()
        self.layout = M3Layout(hidden, head.colbert_dim)
        self.colbert = self._linear(head.colbert, hidden, None)
        self.sparse = self._linear(head.sparse, hidden, 1)

    @staticmethod
    def _linear(path, hidden: int, out: int | None) -> nn.Linear | None:
        if path is None:
            return None
        tensors = load_pt_linear(path, hidden, out)
        layer = nn.Linear(hidden, tensors.shape_out, bias=tensors.bias is not None)
        with torch.no_grad():
            layer.weight.copy_(tensors.weight)
            if tensors.bias is not None:
                layer.bias.copy_(tensors.bias)
        return layer.requires_grad_(False)

    def forward(
        self, tokens: torch.Tensor, first_rows: torch.Tensor, normalize: torch.Tensor | bool
    ) -> torch.Tensor:
        """tokens: [n, hidden] float32; first_rows: [m] rows that start a prompt; normalize:
        per first row (or for all) whether its dense vector is L2-normalised."""
        layout = self.layout
        out = tokens.new_zeros((tokens.shape[0], layout.row_width))
        if self.colbert is not None:
            out[:, : layout.colbert_dim] = l2_normalize(self.colbert(tokens))
        if self.sparse is not None:
            out[:, layout.width] = torch.relu(self.sparse(tokens)).squeeze(1)
        dense = tokens.index_select(0, first_rows)
        if isinstance(normalize, bool):
            dense = l2_normalize(dense) if normalize else dense
        else:
            dense = torch.where(normalize.unsqueeze(1), l2_normalize(dense), dense)
        row = out.index_select(0, first_rows)
        row[:, : layout.width] = 0
        row[:, : layout.hidden] = dense
        out.index_copy_(0, first_rows, row)
        return out


class ColbertTokenHead(nn.Module):
    """PyLate's Dense modules on every token row (float32)."""

    def __init__(self, head: ColbertHead) -> None:
        super().__init__()
        self.dense = DenseHead(head.dense)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.dense(tokens)


def build_token_heads(
    head: RetrievalHead | None, folder: ModelFolder, hidden: int, dtype: torch.dtype,
    device: torch.device,
) -> tuple[SpladeTransform | None, M3TokenHead | ColbertTokenHead | None]:  # fmt: skip
    """The last stage's (vector transform, token head) for a model's retrieval head."""
    if isinstance(head, SpladeHead):
        return SpladeTransform(head, folder, dtype).to(device), None
    if isinstance(head, M3Head):
        return None, M3TokenHead(head, hidden).to(device)
    if isinstance(head, ColbertHead):
        return None, ColbertTokenHead(head).to(device)
    return None, None
