"""``EngineInfo``: what a front end reads of a started engine (``Engine.info``), fixed for the
engine's life (what the model can be asked to do is ``routing.model_tasks``'s answer).

Front ends (the server, the command line, jobs, the sentence-transformers adapters) read the
model's facts here rather than the engine's deployment plan or input preparer: the plan is the
pipeline's (``engine.pipeline.deployment``), the preparer the engine's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ..core.request import PoolingParams
from ..intake.inputs import output_width, pooling_params, prompt_text
from ..loading.model_folder import model_display_name
from .retrieval_scoring import pair_options
from .routing import model_tasks

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..core.classifier_head import ClassifierHead
    from ..loading.deployment import Deployment


@dataclass(frozen=True)
class EngineInfo:
    """The facts of a started engine that front ends read: the model, what it does, its
    limits, its tokenizer's size and its prompts. Immutable (``prompts`` and ``hf_config``
    are read-only views); the same for every call of the engine's life."""

    model: str  # what logs and tables call it: a hub id, else the folder's name
    model_path: str  # the model folder
    architecture: str  # config.json's, e.g. "BertModel"
    hf_config: Mapping[str, Any]  # config.json, read-only
    sentence_transformers: bool  # the folder has sentence-transformers modules
    tasks: tuple[str, ...]  # ``model_tasks``
    outputs: tuple[str, ...]  # dense | sparse | multi_vector, what one text gives
    classifier: ClassifierHead | None  # a classifier's head (labels, activation, ...); else None
    pooling: str  # embed's default pooling: last | mean | cls
    normalize: bool  # embed's default L2 normalisation
    dimensions: int  # size of a pooled vector (after any Dense head)
    token_width: int  # size of a token's vector (pooling "all")
    dense_modules: bool  # sentence-transformers Dense modules after pooling
    hidden_size: int
    max_model_len: int  # tokens of one input
    kv_cache_tokens: int  # 0 for encoders
    causal: bool
    dtype: str  # e.g. "float32"
    devices: tuple[str, ...]  # one per stage (of one replica)
    max_num_batched_tokens: int  # token budget of one step
    max_num_seqs: int  # requests in one step
    vocab_size: int  # the tokenizer's
    prompts: Mapping[str, str]  # the folder's prompt name -> text put before an input
    default_prompt_name: str | None  # applied when a call names none
    similarity_fn_name: str | None  # the folder's (sentence-transformers), None: unset
    pair_options: frozenset[str]  # pair-scoring options it takes (``retrieval_scoring``)
    long_inputs: str  # the engine's policy for inputs over max_model_len
    data_parallel_size: int  # replicas of the pipeline

    @property
    def labels(self) -> tuple[str, ...]:
        """A classifier's label names in label order; () for other models."""
        return self.classifier.labels if self.classifier is not None else ()

    def prompt_text(self, prompt_name: str | None = None) -> str:
        """The text the engine puts before a text input: the prompt ``prompt_name``, else the
        default prompt, else none (""); InvalidInputError for a name the model lacks."""
        return prompt_text(self.prompts, self.default_prompt_name, prompt_name)

    def pooling_params(
        self,
        pooling: str | None = None,
        dimensions: int | None = None,
        normalize: bool | None = None,
    ) -> PoolingParams:
        """The parameters ``Engine.submit`` pools with for these options (None: the model's
        pooling and normalisation), checked as there: what ``Engine.submit_tokens`` takes."""
        pooling = pooling or self.pooling
        width = self.token_width if pooling == "all" else self.dimensions
        return pooling_params(pooling, dimensions, normalize, width=width, default=self.normalize)

    @property
    def num_stages(self) -> int:
        return len(self.devices)

    @classmethod
    def of(cls, deployment: Deployment, config: EngineConfig, vocab_size: int) -> EngineInfo:
        """The info of an engine that runs ``deployment`` as ``config`` asks."""
        folder, st = deployment.folder, deployment.folder.st
        return cls(
            model=model_display_name(folder.path),
            model_path=str(folder.path),
            architecture=folder.architecture,
            hf_config=MappingProxyType(dict(folder.hf_config)),
            sentence_transformers=st is not None,
            tasks=model_tasks(deployment),
            outputs=deployment.outputs,
            classifier=deployment.classifier,
            pooling=deployment.pooling,
            normalize=deployment.normalize,
            dimensions=deployment.output_dim,
            token_width=output_width(deployment, "all"),
            dense_modules=bool(st and st.dense),
            hidden_size=deployment.hidden_size,
            max_model_len=deployment.max_model_len,
            kv_cache_tokens=deployment.kv_cache_tokens,
            causal=deployment.causal,
            dtype=str(deployment.dtype).removeprefix("torch."),
            devices=tuple(deployment.devices),
            max_num_batched_tokens=deployment.max_num_batched_tokens,
            max_num_seqs=deployment.max_num_seqs,
            vocab_size=vocab_size,
            prompts=MappingProxyType(dict(st.prompts) if st else {}),
            default_prompt_name=st.default_prompt_name if st else None,
            similarity_fn_name=st.similarity_fn_name if st else None,
            pair_options=pair_options(deployment),
            long_inputs=config.long_inputs,
            data_parallel_size=config.data_parallel_size,
        )
