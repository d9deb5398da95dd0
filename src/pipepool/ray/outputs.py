"""What an ``EmbedBatches`` adds to a batch: the output kinds the Engine offers, the engine call
that computes each, and the columns each one fills.

- ``dense``: ``Engine.embed``; column NAME (default "embedding"), one ``[dim]`` float32 tensor
  per row (the column reads back as one ``[n, dim]`` array).
- ``sparse``: SPLADE's vocabulary weights, BGE-M3's lexical weights (``Retriever.embed_sparse``);
  columns NAME_indices (``list<int64>``, token ids ascending) and NAME_values (``list<float>``,
  all > 0); default NAME "sparse".
- ``multi_vector``: ColBERT's or BGE-M3's token vectors (``Retriever.embed_multi_vector``); column
  NAME, one ``[tokens, dim]`` float32 tensor per row; default NAME "multi_vector".
- ``token_embeddings``: the last hidden state of every token (``Engine.embed_tokens``); as
  multi_vector; default NAME "token_embeddings".
- ``score``: a cross-encoder's (or reranker's, ColBERT's MaxSim, BGE-M3's) score of each row's
  query and document (``Engine.score``, pairwise); column NAME, float32; default "score".
- ``classify``: a sequence classifier's labels (``Engine.classify``); column NAME (string, the
  top label; default "label") and NAME_probs (one ``[num_labels]`` float32 tensor per row).

dense, sparse and multi_vector may be asked for together (BGE-M3: one forward pass gives all
three, ``Engine.encode_outputs``); the other kinds stand alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from ..errors import InvalidInputError
from ..loading.retrieval import OUTPUTS as RETRIEVAL_KINDS
from .columns import list_column, ragged_column, vectors_column

if TYPE_CHECKING:
    from ..api.engine import Engine

KINDS = (*RETRIEVAL_KINDS, "token_embeddings", "score", "classify")
DEFAULT_COLUMNS = {
    "dense": "embedding",
    "sparse": "sparse",
    "multi_vector": "multi_vector",
    "token_embeddings": "token_embeddings",
    "score": "score",
    "classify": "label",
}


@dataclass(frozen=True)
class OutputPlan:
    """The outputs an ``EmbedBatches`` adds to every batch, and the columns it reads for them."""

    kinds: tuple[str, ...]  # in KINDS order; several only among RETRIEVAL_KINDS
    names: dict[str, str]  # kind -> its column (sparse and classify: the stem of their two)
    inputs: tuple[str, ...]  # columns read: the text column, or (query, document) for score

    def __post_init__(self) -> None:
        assert self.kinds and set(self.kinds) <= set(KINDS), self.kinds
        assert len(self.kinds) == 1 or set(self.kinds) <= set(RETRIEVAL_KINDS), self.kinds
        assert set(self.names) == set(self.kinds)
        assert len(self.inputs) == (2 if self.kinds == ("score",) else 1)

    @property
    def columns(self) -> tuple[str, ...]:
        """Every column the outputs add, in the order they are appended."""
        added: list[str] = []
        for kind in self.kinds:
            name = self.names[kind]
            if kind == "sparse":
                added += [f"{name}_indices", f"{name}_values"]
            elif kind == "classify":
                added += [name, f"{name}_probs"]
            else:
                added.append(name)
        return tuple(added)


def plan_outputs(
    output: str | Sequence[str],
    output_column: str | Mapping[str, str] | None,
    *,
    text_column: str,
    query_column: str,
    document_column: str,
) -> OutputPlan:
    """The plan for ``output`` (a kind, or several retrieval kinds) and ``output_column`` (the
    column of a single kind, or kind -> column; default ``DEFAULT_COLUMNS``); InvalidInputError
    naming what is wrong."""
    asked = [output] if isinstance(output, str) else list(output)
    unknown = [k for k in asked if k not in KINDS]
    if unknown or not asked or len(set(asked)) < len(asked):
        raise InvalidInputError(
            f"output must be one of {', '.join(KINDS)}, or several of "
            f"{', '.join(RETRIEVAL_KINDS)}; got {output!r}",
            param="output",
        )
    kinds = tuple(k for k in KINDS if k in asked)
    if len(kinds) > 1 and not set(kinds) <= set(RETRIEVAL_KINDS):
        raise InvalidInputError(
            f"only {', '.join(RETRIEVAL_KINDS)} can be computed together; got {output!r}",
            param="output",
        )
    if isinstance(output_column, str):
        if len(kinds) > 1:
            raise InvalidInputError(
                "several outputs take output_column as a mapping of output to column name",
                param="output_column",
            )
        given: Mapping[str, str] = {kinds[0]: output_column}
    else:
        given = output_column or {}
    stray = sorted(set(given) - set(kinds))
    if stray:
        raise InvalidInputError(
            f"output_column names {', '.join(stray)}, which output does not ask for",
            param="output_column",
        )
    names = {k: given.get(k, DEFAULT_COLUMNS[k]) for k in kinds}
    inputs = (query_column, document_column) if kinds == ("score",) else (text_column,)
    plan = OutputPlan(kinds, names, inputs)
    if len(set(plan.columns)) < len(plan.columns):
        raise InvalidInputError(
            f"two outputs would fill one column: {plan.columns}", param="output_column"
        )
    return plan


def check_model(engine: Engine, plan: OutputPlan) -> None:
    """Refuse, before the first batch, outputs the model cannot give (retrieval kinds it lacks;
    labels of a model that is no classifier)."""
    from ..api.retrieval import check_outputs  # torch: in the actor, as the engine

    if set(plan.kinds) <= set(RETRIEVAL_KINDS):
        check_outputs(engine.info.outputs, plan.kinds)
    if plan.kinds == ("classify",) and engine.info.classifier is None:
        raise InvalidInputError(
            "output='classify' needs a sequence-classification model", param="output"
        )


def compute(
    engine: Engine, plan: OutputPlan, inputs: list[list[str]], options: dict[str, Any]
) -> dict[str, pa.Array]:
    """The plan's columns for a batch whose ``inputs`` (one list per ``plan.inputs`` column) are
    checked strings; ``options`` go to the engine call as they are."""
    texts = inputs[0]
    kinds, names = plan.kinds, plan.names
    if kinds == ("score",):
        queries, documents = inputs
        scores = engine.score(queries, documents, **options) if texts else np.empty(0)
        return {names["score"]: pa.array(np.asarray(scores, np.float32), pa.float32())}
    if kinds == ("classify",):
        return _classify(engine, texts, names["classify"], options)
    if kinds == ("token_embeddings",):
        tokens = engine.embed_tokens(texts, **options) if texts else []
        return {names["token_embeddings"]: ragged_column(tokens)}
    if kinds == ("dense",):  # embed: every dense option (dimensions, long_inputs="chunk")
        return {names["dense"]: vectors_column(engine.embed(texts, **options))}
    out = engine.encode_outputs(texts, kinds, **options)
    columns: dict[str, pa.Array] = {}
    if out.dense is not None:
        columns[names["dense"]] = vectors_column(out.dense)
    if out.sparse is not None:
        stem = names["sparse"]
        columns[f"{stem}_indices"] = list_column([s.indices for s in out.sparse], pa.int64())
        columns[f"{stem}_values"] = list_column([s.values for s in out.sparse], pa.float32())
    if out.multi_vector is not None:
        columns[names["multi_vector"]] = ragged_column(out.multi_vector)
    return columns


def _classify(
    engine: Engine, texts: list[str], name: str, options: dict[str, Any]
) -> dict[str, pa.Array]:
    head = engine.info.classifier
    assert head is not None, "check_model refuses a model that is no classifier"
    if texts:
        result = engine.classify(texts, **options)
        probs, labels = result.probs, result.labels
    else:
        probs, labels = np.empty((0, head.num_labels), np.float32), []
    return {name: pa.array(labels, pa.string()), f"{name}_probs": vectors_column(probs)}
