"""What a classifier's scores are compared with: raw logits of each pair (before any
activation), one pair at a time, from

- sentence-transformers' ``CrossEncoder`` for encoder cross-encoders (it tokenizes the text
  pairs itself, so the engine's pair encoding is checked too; transformers'
  ``AutoModelForSequenceClassification`` on the engine's token ids and token types where
  sentence-transformers is not installed);
- transformers' ``AutoModelForSequenceClassification`` for decoder classifiers, on the
  engine's token ids;
- transformers' ``AutoModelForCausalLM`` for Qwen3-Reranker: logit("yes") - logit("no") at
  the last token, on the engine's token ids (its prompt);
- or the engine itself with one stage and whole prompts (``pp1``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import numpy as np

from ..config import EngineConfig
from ..errors import PipepoolError
from ..intake.inputs import TokenSlice
from ..loading.deployment import Deployment
from .reference import (
    ParityError,
    ReferenceOutputs,
    _dtype_name,
    _release,
    _require,
    exact_attention,
)


def score_reference(
    kind: str,
    deployment: Deployment,
    pairs: tuple[list[str], list[str]],
    tokens: TokenSlice,
    *,
    device: str | None = None,
    dtype: str | None = None,
) -> ReferenceOutputs:
    """``outputs["score"]``: one raw logit array ([num_labels]) per pair; ``pairs`` is
    (queries, documents), or ([], texts) for a classifier of several labels."""
    if kind == "pp1":
        return _engine_reference(deployment.config, pairs, tokens)
    if kind != "transformers":
        raise ParityError(f"unknown reference {kind!r}; choose one of transformers, pp1")
    import torch

    where = (device or deployment.devices[0], getattr(torch, dtype) if dtype else deployment.dtype)
    head = deployment.classifier
    assert head is not None, "scores come from a classifier"
    if head.kind in ("bert", "roberta") and importlib.util.find_spec("sentence_transformers"):
        return _cross_encoder(deployment, pairs, *where)
    return _transformers(deployment, tokens, *where)


def _cross_encoder(deployment: Deployment, pairs, device, dtype) -> ReferenceOutputs:
    st_lib = _require("sentence_transformers", "the CrossEncoder reference")
    import torch

    path = str(deployment.folder.path)
    model = st_lib.CrossEncoder(path, device=device, max_length=deployment.max_model_len)
    model = model.to(dtype)
    try:
        scores = model.predict(
            list(zip(*pairs, strict=True)),
            batch_size=1,  # one pair at a time: no padding effects
            activation_fn=torch.nn.Identity(),
            convert_to_numpy=True,
            show_progress_bar=False,
        )
    finally:
        del model
        _release(device)
    outputs = [np.atleast_1d(np.asarray(s, dtype=np.float32)) for s in scores]
    name = f"sentence-transformers {st_lib.__version__} CrossEncoder (raw logits)"
    return ReferenceOutputs(f"{name}, {_dtype_name(dtype)} on {device}", {"score": outputs})


def _transformers(deployment: Deployment, tokens: TokenSlice, device, dtype) -> ReferenceOutputs:
    transformers = _require("transformers", "the transformers reference")
    import torch

    head = deployment.classifier
    assert head is not None, "scores come from a classifier"
    path = str(deployment.folder.path)
    auto = "AutoModelForCausalLM" if head.kind == "yes_no" else "AutoModelForSequenceClassification"
    model = getattr(transformers, auto).from_pretrained(
        path, dtype=dtype, **exact_attention(deployment)
    )
    model = model.to(device).eval()
    bounds = np.cumsum(tokens.lengths)[:-1]
    ids = np.split(tokens.token_ids, bounds)
    types = np.split(tokens.type_ids, bounds) if tokens.type_ids is not None else None
    outputs = []
    try:
        with torch.inference_mode():
            for i, prompt in enumerate(ids):
                kwargs = {"input_ids": torch.as_tensor(prompt, device=device)[None]}
                if types is not None:
                    kwargs["token_type_ids"] = torch.as_tensor(types[i], device=device)[None]
                logits = model(**kwargs).logits[0].float()
                if head.kind == "yes_no":  # the last token's yes and no logits
                    yes, no = head.token_rows
                    logits = (logits[-1, yes] - logits[-1, no]).reshape(1)
                outputs.append(logits.cpu().numpy())
    finally:
        del model
        _release(device)
    name = f"transformers {transformers.__version__} {auto} (raw logits)"
    return ReferenceOutputs(f"{name}, {_dtype_name(dtype)} on {device}", {"score": outputs})


def _engine_reference(
    config: EngineConfig, pairs: tuple[Sequence[str], Sequence[str]], tokens: TokenSlice
) -> ReferenceOutputs:
    from ..api.engine import Engine

    budget = int(tokens.lengths.max())  # every prompt fits in one step: no chunking
    ref_config = config.replace(
        pipeline_parallel_size=1, pp_partition=None, max_num_batched_tokens=budget
    )
    try:
        with Engine.from_config(ref_config) as engine:
            if pairs[0]:
                scores = engine.submit_pairs(*pairs, use_activation=False, long_inputs="error")
            else:  # a classifier of several labels: the texts alone
                scores = engine.submit_classify(pairs[1], use_activation=False, long_inputs="error")
            outputs = list(scores.result())
            d = engine.pipeline.deployment
    except PipepoolError as exc:
        raise ParityError(f"the PP=1 reference engine failed: {exc}") from exc
    description = (
        f"pipepool PP=1, whole prompts (budget {budget}), {_dtype_name(d.dtype)} on {d.devices[0]}"
    )
    return ReferenceOutputs(description, {"score": outputs})
