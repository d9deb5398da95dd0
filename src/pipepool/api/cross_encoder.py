"""sentence-transformers' ``CrossEncoder`` as an adapter over an ``Engine``, with its semantics,
so code written for it runs on the engine unchanged: ``predict``, ``rank``, and the attributes
``num_labels`` and ``activation_fn`` (the shared ones, ``prompts``, ``max_seq_length``, ... are
``st_attributes.STAdapter``'s).

Pairs are tokenized as there (the prompt before each first text, truncated longest-first to
``max_seq_length``) and scored by the engine as raw logits (``Engine.submit_pairs``); the
activation runs here, on the caller's thread, so that a caller's ``activation_fn`` applies as
in sentence-transformers.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import InvalidInputError
from .engine import Engine
from .progress import follow
from .scoring import need_classifier
from .st_attributes import STAdapter, check_batch_size, refuse_unknown, renamed

if TYPE_CHECKING:
    from ..core.classifier_head import ClassifierHead
    from .engine_info import EngineInfo

log = logging.getLogger("pipepool")
# sentence-transformers' CrossEncoder activations, by the names classifier.py gives them.
_ACTIVATIONS: dict[str, Callable[[], torch.nn.Module]] = {
    "identity": torch.nn.Identity,
    "sigmoid": torch.nn.Sigmoid,
    "softmax": torch.nn.Softmax,
    "tanh": torch.nn.Tanh,
    "relu": torch.nn.ReLU,
}


class CrossEncoder(STAdapter):
    """sentence-transformers' ``CrossEncoder`` over an ``Engine``: its methods and attributes
    with its semantics. ``CrossEncoder(model, **options)`` starts and owns an Engine
    (``options``: ``EngineConfig`` fields, ``device`` among them); ``CrossEncoder(engine)``
    shares one (``STAdapter``). ``max_length`` and ``activation_fn`` are set as
    sentence-transformers' constructor sets them. Needs a classifier (a cross-encoder or
    reranker): on an embedding model ``predict``, ``rank`` and ``num_labels`` raise
    ``InvalidInputError`` saying so, as bad options do (a ``ValueError``, as
    sentence-transformers raises). Every method is thread-safe; an ``activation_fn`` a caller
    sets applies to this adapter's ``predict`` / ``rank`` only (the engine's ``score``,
    ``rerank`` and ``classify`` keep the model's)."""

    def __init__(
        self,
        model_name_or_path: str | os.PathLike[str] | Engine | None = None,
        *,
        max_length: int | None = None,
        activation_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
        **engine_options: Any,
    ) -> None:
        super().__init__(model_name_or_path, **engine_options)
        try:
            if max_length is not None:
                self.max_seq_length = max_length
        except BaseException:
            self.close()
            raise
        self.activation_fn = activation_fn

    def predict(
        self,
        inputs: Any = None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        activation_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
        apply_softmax: bool | None = False,
        convert_to_numpy: bool = True,
        convert_to_tensor: bool = False,
        device: Any = None,
        pool: Any = None,
        chunk_size: int | None = None,
        **kwargs: Any,
    ) -> Any:
        """``CrossEncoder.predict``: one score per ``(text, text)`` pair (``[n]`` float32 for one
        label, ``[n, num_labels]`` for several; one pair gives one row). The logits come from the
        engine; ``activation_fn`` (default ``self.activation_fn``), then with ``apply_softmax``
        a softmax over the labels, apply as there. ``convert_to_tensor``: a tensor;
        ``convert_to_numpy=False``: a list of tensors. Pairs are truncated longest-first to
        ``max_seq_length``; ``prompt`` goes before each first text. ``batch_size`` is checked
        and otherwise unused; ``chunk_size`` is unused."""
        inputs = renamed(kwargs, "sentences", inputs)
        activation_fn = renamed(kwargs, "activation_fct", activation_fn)
        kwargs.pop("num_workers", None)  # deprecated there, no effect
        refuse_unknown(kwargs, "predict")
        if show_progress_bar is None:
            show_progress_bar = log.getEffectiveLevel() in (logging.INFO, logging.DEBUG)
        check_batch_size(batch_size)
        single = _is_single_pair(inputs)
        pairs = [_pair(inputs, 0)] if single else [_pair(p, i) for i, p in enumerate(inputs)]
        self._check_device(device, pool)
        need_classifier(self.engine.info, "CrossEncoder.predict")
        prefix = self._resolve_prompt(prompt, prompt_name)
        if prefix and self._head.template != "pair":
            raise InvalidInputError(
                "this reranker reads its own prompt around query and document; give its "
                "instruction to rerank(..., instruction=...) instead of a prompt",
                param="prompt",
            )
        logits = self._pair_logits(pairs, prefix or "", show_progress_bar)  # [n, num_labels]
        scores = (activation_fn or self.activation_fn)(logits)
        if apply_softmax and scores.ndim > 1:
            scores = torch.nn.functional.softmax(scores, dim=1)
        if self.num_labels == 1 and scores.ndim > 1:
            scores = scores.squeeze(-1)
        if convert_to_tensor:
            out: Any = scores
        elif convert_to_numpy:
            out = scores.float().numpy()
        else:
            out = list(scores)
        return out[0] if single else out

    def rank(
        self,
        query: str,
        documents: Sequence[str],
        top_k: int | None = None,
        return_documents: bool = False,
        prompt_name: str | None = None,
        prompt: str | None = None,
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        activation_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
        apply_softmax: bool | None = False,
        device: Any = None,
        pool: Any = None,
        chunk_size: int | None = None,
        **kwargs: Any,
    ) -> list[dict[str, Any]]:
        """``CrossEncoder.rank``: ``{"corpus_id", "score"[, "text"]}`` per document, highest
        score first (ties in input order), the first ``top_k`` (None: all; 0: none); scores as
        ``predict`` gives them, Python floats. Needs a model with one label."""
        for legacy in ("convert_to_numpy", "convert_to_tensor", "num_workers"):
            kwargs.pop(legacy, None)  # accepted there, with no effect
        if kwargs:
            raise InvalidInputError(
                f"rank() got keyword arguments this engine does not use: {sorted(kwargs)}"
            )
        if self.num_labels != 1:
            raise InvalidInputError(
                "CrossEncoder.rank() only works for models with num_labels=1; use predict() "
                "with input pairs instead",
                param="model",
            )
        scores = self.predict(
            [[query, document] for document in documents],
            prompt_name=prompt_name,
            prompt=prompt,
            batch_size=batch_size,
            show_progress_bar=show_progress_bar,
            activation_fn=activation_fn,
            apply_softmax=apply_softmax,
            convert_to_tensor=True,
            device=device,
            pool=pool,
            chunk_size=chunk_size,
        ).tolist()
        results: list[dict[str, Any]] = [{"corpus_id": i, "score": s} for i, s in enumerate(scores)]
        if return_documents:
            for result in results:
                result["text"] = documents[result["corpus_id"]]
        return sorted(results, key=lambda r: r["score"], reverse=True)[:top_k]

    @property
    def num_labels(self) -> int:
        """Scores per pair (``CrossEncoder.num_labels``)."""
        need_classifier(self.engine.info, "CrossEncoder.num_labels")
        return self._head.num_labels

    @property
    def activation_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """What ``predict`` applies to the logits unless a call says: the activation the
        folder's sentence-transformers config names, else ``Sigmoid`` for one label and
        ``Identity`` for several (``CrossEncoder``'s rule; ``classify`` gives softmax
        probabilities there). A caller may set another."""
        chosen = self._st.activation_fn
        return chosen if chosen is not None else self._default_activation

    @activation_fn.setter
    def activation_fn(self, fn: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        self._st.activation_fn = fn

    @property
    def _head(self) -> ClassifierHead:
        """The classifier's head, for calls ``need_classifier`` let through."""
        head = self.engine.info.classifier
        assert head is not None, "need_classifier refuses embedding models first"
        return head

    @cached_property
    def _default_activation(self) -> torch.nn.Module:
        need_classifier(self.engine.info, "CrossEncoder.activation_fn")
        name = self._head.activation
        if self._head.num_labels > 1 and not _names_activation(self.engine.info):
            name = "identity"  # classifier.py's default there is softmax, as vLLM's classify
        return _ACTIVATIONS[name]()

    def _pair_logits(
        self, pairs: list[tuple[str, str]], prefix: str, show_progress_bar: bool
    ) -> torch.Tensor:
        """``[n, num_labels]`` float32 logits of the pairs, truncated to ``max_seq_length``."""
        if not pairs:
            return torch.zeros((0, self._head.num_labels))
        queries = [prefix + query for query, _ in pairs]
        documents = [document for _, document in pairs]
        submission = self.engine.submit_pairs(
            queries, documents, use_activation=False, per_label=True,
            truncate_prompt_tokens=self.max_seq_length, long_inputs="truncate",
        )  # fmt: skip
        follow(submission, disable=not show_progress_bar, desc="Batches")
        return torch.from_numpy(submission.result())


def _is_single_pair(inputs: Any) -> bool:
    """``CrossEncoder.is_singular_input``: a list or tuple whose first item is not itself a list
    or tuple is one pair; a 1-D string array too."""
    if isinstance(inputs, (list, tuple)):
        return len(inputs) > 0 and not isinstance(inputs[0], (list, tuple))
    if isinstance(inputs, np.ndarray) and inputs.dtype.kind in "UO":
        return inputs.size > 0 and inputs.ndim < 2
    return True


def _pair(pair: Any, index: int) -> tuple[str, str]:
    if isinstance(pair, np.ndarray):
        pair = pair.tolist()
    if (
        not isinstance(pair, (list, tuple))
        or len(pair) != 2
        or not all(isinstance(text, str) for text in pair)
    ):
        raise InvalidInputError(
            f"input {index} is not a pair of two texts: predict takes [text, text] pairs",
            param="inputs",
            index=index,
        )
    return pair[0], pair[1]


def _names_activation(info: EngineInfo) -> bool:
    """Whether the folder's sentence-transformers settings name an activation (else the
    CrossEncoder default applies; classifier.py reads which one)."""
    hf = info.hf_config
    if (hf.get("sentence_transformers") or {}).get("activation_fn") is not None:
        return True
    if hf.get("sbert_ce_default_activation_function") is not None:
        return True
    path = Path(info.model_path) / "config_sentence_transformers.json"
    if not path.is_file():
        return False
    return json.loads(path.read_text(encoding="utf-8")).get("activation_fn") is not None
