"""What the engine is compared with: Hugging Face ``transformers`` (``sentence-transformers``
for sentence-transformers folders) on the same weights, or the engine itself with one stage
and one chunk per prompt.

The Hugging Face libraries are optional dependencies, imported only when asked for. Every
reference runs one prompt at a time (no padding, no batching effects) and returns raw,
unnormalised outputs, as the engine does with ``normalize=False``.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import EngineConfig
from ..errors import PipepoolError
from ..loading.deployment import Deployment

REFERENCES = ("transformers", "pp1")


class ParityError(PipepoolError):
    """The parity run itself cannot proceed (missing dependency, reference failed)."""


@dataclass(frozen=True)
class ReferenceOutputs:
    """The reference's outputs for every prompt, per pooling, and what produced them (in
    words, for the report)."""

    description: str  # e.g. "transformers 5.17.0 AutoModel, float32 on cpu"
    outputs: dict[str, list[np.ndarray]]  # pooling -> one output per prompt


def compute_reference(
    kind: str,
    deployment: Deployment,
    texts: Sequence,
    token_ids: list[np.ndarray],
    poolings: Sequence[str],
    *,
    device: str | None = None,
    dtype: str | None = None,
) -> ReferenceOutputs:
    """Reference outputs for every prompt and pooling; the reference model is released before
    this returns, so the engines under test get the device to themselves. ``device`` and
    ``dtype`` place the transformers reference (default: where the engine runs)."""
    if kind == "pp1":
        return _engine_reference(deployment.config, token_ids, poolings)
    if kind != "transformers":
        raise ParityError(f"unknown reference {kind!r}; choose one of {', '.join(REFERENCES)}")
    import torch

    where = (device or deployment.devices[0], getattr(torch, dtype) if dtype else deployment.dtype)
    if deployment.folder.st is not None:
        return _sentence_transformers_reference(deployment, texts, poolings, *where)
    return _transformers_reference(deployment, token_ids, poolings, *where)


def pool(hidden: np.ndarray, pooling: str) -> np.ndarray:
    """``hidden``: [len, H] final hidden states of one prompt."""
    if pooling == "last":
        return hidden[-1]
    if pooling == "cls":
        return hidden[0]
    h = hidden.astype(np.float64)
    if pooling == "mean":
        return h.mean(0).astype(np.float32)
    if pooling == "max":
        return hidden.max(0)
    if pooling == "mean_sqrt_len":
        return (h.sum(0) / np.sqrt(len(h))).astype(np.float32)
    if pooling == "weightedmean":  # sentence-transformers' weights: 1, 2, ..., length
        w = np.arange(1, len(h) + 1, dtype=np.float64)[:, None]
        return ((h * w).sum(0) / w.sum()).astype(np.float32)
    if pooling == "all":
        return hidden
    raise ParityError(f"unknown pooling {pooling!r}")


def exact_attention(deployment: Deployment) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments that make transformers compute the checkpoint's
    whole attention math: Gemma2 soft-caps attention logits (50 unless its config says), which
    transformers' default (sdpa) attention ignores and its eager attention applies."""
    hf = deployment.folder.hf_config
    if hf.get("model_type") == "gemma2" or hf.get("attn_logit_softcapping") is not None:
        return {"attn_implementation": "eager"}
    return {}


def _require(module: str, why: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ParityError(
            f"{why} needs the optional package {module!r} (pip install {module}), "
            "or use --reference pp1 to compare with the engine itself"
        ) from None


def _transformers_reference(
    deployment: Deployment, token_ids: list[np.ndarray], poolings: Sequence[str], device, dtype
) -> ReferenceOutputs:
    transformers = _require("transformers", "the transformers reference")
    import torch

    path = str(deployment.folder.path)
    kwargs: dict[str, Any] = exact_attention(deployment)
    hf = deployment.folder.hf_config
    if deployment.config.attention != "auto":
        # The user named the attention (a checkpoint with remote code, or an override): the
        # reference is transformers' built-in family with that attention.
        config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=False)
        config.is_causal = deployment.causal
        kwargs.update(config=config, trust_remote_code=False)
    # T5: an embedding model runs its encoder only (AutoModel would build the whole T5Model).
    auto = transformers.T5EncoderModel if hf.get("model_type") == "t5" else transformers.AutoModel
    model = auto.from_pretrained(path, dtype=dtype, **kwargs)
    model = model.to(device).eval()
    outputs: dict[str, list[np.ndarray]] = {p: [] for p in poolings}
    try:
        with torch.inference_mode():
            for ids in token_ids:
                # The engine's own token ids, so both sides see exactly the same tokens.
                batch = torch.as_tensor(ids, device=device)[None]
                hidden = model(input_ids=batch).last_hidden_state[0].float().cpu().numpy()
                for p in poolings:
                    outputs[p].append(pool(hidden, p))
    finally:
        del model
        _release(device)
    name = f"transformers {transformers.__version__} AutoModel"
    return ReferenceOutputs(f"{name}, {_dtype_name(dtype)} on {device}", outputs)


def _sentence_transformers_reference(
    deployment: Deployment, texts: Sequence, poolings: Sequence[str], device, dtype
) -> ReferenceOutputs:
    st_lib = _require("sentence_transformers", "the reference for a sentence-transformers folder")
    if not all(isinstance(t, str) for t in texts):
        raise ParityError(
            "the sentence-transformers reference needs text prompts, not token ids "
            "(or use --reference pp1)"
        )
    model = st_lib.SentenceTransformer(str(deployment.folder.path), device=device).to(dtype)
    # encode(normalize_embeddings=False) does not switch off a Normalize module of the
    # pipeline, and parity compares raw vectors: take Normalize out.
    for key in [k for k, m in model._modules.items() if type(m).__name__ == "Normalize"]:
        del model._modules[key]
    dense = [m for m in model._modules.values() if type(m).__name__ == "Dense"]
    st = deployment.folder.st
    assert st is not None, "only for a sentence-transformers folder"
    own = st.pooling
    outputs: dict[str, list[np.ndarray]] = {p: [] for p in poolings}
    try:
        for text in texts:
            out = model.encode(
                [text],
                output_value=None,  # both sentence_embedding and token_embeddings
                convert_to_numpy=True,
                normalize_embeddings=False,
                show_progress_bar=False,
            )[0]
            tokens = out["token_embeddings"].float().cpu().numpy()
            for p in poolings:
                if p == own:  # the model's own pipeline: Pooling, then Dense modules
                    vector = out["sentence_embedding"].float().cpu().numpy()
                elif p == "all":
                    vector = tokens
                else:  # another pooling of the same tokens, through the same Dense modules
                    vector = _apply_dense(dense, pool(tokens, p), device, dtype)
                outputs[p].append(vector)
    finally:
        del model
        _release(device)
    name = f"sentence-transformers {st_lib.__version__}"
    return ReferenceOutputs(f"{name}, {_dtype_name(dtype)} on {device}", outputs)


def _apply_dense(dense: list, vector: np.ndarray, device: str, dtype) -> np.ndarray:
    import torch

    if not dense:
        return vector
    features = {"sentence_embedding": torch.as_tensor(vector, device=device, dtype=dtype)[None]}
    with torch.inference_mode():
        for module in dense:
            features = module(features)
    return features["sentence_embedding"][0].float().cpu().numpy()


def _engine_reference(
    config: EngineConfig, token_ids: list[np.ndarray], poolings: Sequence[str]
) -> ReferenceOutputs:
    from ..api.engine import Engine

    budget = max(len(ids) for ids in token_ids)  # every prompt fits in one step: no chunking
    ref_config = config.replace(
        pipeline_parallel_size=1,
        pp_partition=None,
        max_num_batched_tokens=budget,
        # int8 is measured against float32: its reference is the float32 engine
        dtype="float32" if config.dtype == "int8" else config.dtype,
    )
    try:
        with Engine.from_config(ref_config) as engine:
            outputs = {p: engine.pool(token_ids, pooling=p, normalize=False) for p in poolings}
            d = engine.pipeline.deployment
    except PipepoolError as exc:
        raise ParityError(f"the PP=1 reference engine failed: {exc}") from exc
    description = (
        f"pipepool PP=1, whole prompts (budget {budget}), {_dtype_name(d.dtype)} on {d.devices[0]}"
    )
    return ReferenceOutputs(description, outputs)


def _release(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")
