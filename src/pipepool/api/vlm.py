"""Texts with images in, vectors out: a vision-language embedder (Qwen2-VL,
``models/qwen2_vl.py``) on the engine's own pipeline.

A call of dict inputs (``{"text": ..., "image": ...}`` or ``"images": [...]``; every input a
dict) or of conversations (``intake/vlm_chat.ChatPrompt``: rendered by the model's chat template
as vLLM renders a chat-form embedding request) is formatted as the folder's processor formats it
(``intake/vlm_inputs.py``), its images decoded and preprocessed on a pool of threads (PIL
releases the GIL), and enqueued in slices, as they are ready, whose prompts carry their media
rows and images: the scheduler chunks them as any causal prompt, through an image's
placeholders too, the first stage runs the vision tower once per image, and every stage
applies the plan's M-RoPE positions
(``core/media.py``). Plain text inputs take the engine's text path. ColQwen2 and ColPali take
queries and pages the same way (``page_retrieval.py``); ColPali's prompts are bidirectional,
so they go whole into a step."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..config import EngineConfig
from ..core.priority import current_client, is_background
from ..core.submission import Submission
from ..driver.pipeline import Pipeline
from ..errors import InvalidInputError
from ..intake.colpali_inputs import ColPaliFormatter
from ..intake.images import ImageLimits, is_image_input
from ..intake.inputs import InputPreparer, TokenSlice
from ..intake.token_budget import TokenBudget
from ..intake.vlm_chat import ChatPrompt
from ..intake.vlm_inputs import ColQwen2Formatter, VlmFormatter, parse_input
from ..loading.deployment import Deployment
from ..models import family_of
from ..runtime.cores import usable_cpus
from .images import refuse_text_options

# Page retrieval models (one vector per token, MaxSim), by family: their name in messages.
PAGE_RETRIEVERS = {"colqwen2": "ColQwen2", "colpali": "ColPali"}
# The families whose checkpoints take dict inputs with images: those that render their chat
# template (one vector per input), and the page retrievers (queries and pages).
CHAT_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
PAGE_FAMILIES = tuple(PAGE_RETRIEVERS)
VLM_FAMILIES = CHAT_FAMILIES + PAGE_FAMILIES
# Threads that decode and preprocess images (PIL and numpy release the GIL): measured on a
# 16-core host, 4 threads took 8.7 ms an input of a Qwen2-VL-2B-sized embedder, 8 took 4.8.
MAX_DECODE_THREADS = 8
# Inputs per enqueued slice: the device starts once the first few are ready.
SLICE_INPUTS = 8


def is_multimodal_call(inputs) -> bool:
    """Whether a call's inputs are dicts (texts with images) or conversations (``ChatPrompt``)
    rather than texts or images."""
    if isinstance(inputs, (dict, ChatPrompt)):
        return True
    return isinstance(inputs, (list, tuple)) and any(
        isinstance(i, (dict, ChatPrompt)) for i in inputs
    )


def colqwen2_inputs(inputs) -> list | None:
    """A ColQwen2 / ColPali call of plain texts or plain images as its dict inputs (a text is a
    query, an image a page, as its processor takes them); None for other calls (token ids,
    dicts)."""
    items = [inputs] if isinstance(inputs, str) or is_image_input(inputs) else inputs
    if not isinstance(items, (list, tuple)) or not items:
        return None
    if not all(isinstance(i, str) or is_image_input(i) for i in items):
        return None
    return [{"text": i} if isinstance(i, str) else {"image": i} for i in items]


class VlmInputs:
    """A vision-language engine's dict inputs. ``submit(items, params)`` formats, decodes and
    preprocesses every input on a pool of threads and enqueues them in slices, in order, as
    they are ready; returns the call's future, ``[n, D]`` float32 in input order. A bad input
    raises ``InvalidInputError`` naming the first such index, and nothing of the call stays
    queued (slices already enqueued are cancelled)."""

    def __init__(self, config: EngineConfig, pipeline: Pipeline) -> None:
        d = pipeline.deployment
        folder = config.allowed_local_media_path
        limits = ImageLimits(Path(folder) if folder else None, config.max_image_pixels)
        family = family_of(d.folder.architecture)
        # ColQwen2, ColPali: queries and pages in their processor's formats, a vector a token.
        self.model_name = PAGE_RETRIEVERS.get(family.name, "")
        self.multi_vector = bool(self.model_name)
        self.formatter = prompt_formatter(d, limits)
        self.pipeline, self.deployment = pipeline, d
        threads = min(MAX_DECODE_THREADS, usable_cpus())
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="pipepool-vlm")

    def _refuse_chat_forms(self, items: list) -> None:
        """A page retriever's inputs: a chat prompt, then an instruction, refused by name."""
        refusals = (
            (lambda item: isinstance(item, ChatPrompt), "{model} renders no chat template"),
            (lambda item: isinstance(item, dict) and "instruction" in item,
             "'instruction' is not taken by {model}"),
        )  # fmt: skip
        for found, refusal in refusals:
            index = next((i for i, item in enumerate(items) if found(item)), None)
            if index is not None:
                raise InvalidInputError(
                    f"input {index}: {refusal.format(model=self.model_name)}: it embeds a query "
                    "(a text) or a page (one image) in its processor's formats",
                    param="input", index=index,
                )  # fmt: skip

    def submit(self, items: list, params, budget: TokenBudget | None = None) -> Submission:
        if self.multi_vector and params.pooling != "all":
            raise InvalidInputError(
                f"{self.model_name} gives one vector per token (pooling 'all'), not "
                f"{params.pooling!r}",
                param="pooling",
            )
        if self.multi_vector:
            self._refuse_chat_forms(items)
        parsed = [parse_input(item, i) for i, item in enumerate(items)]
        submission = Submission(
            params, len(items), params.dimensions or self.deployment.output_dim,
            on_cancel=self.pipeline.cancel, background=is_background(), client=current_client(),
        )  # fmt: skip
        if not items:
            return submission
        # Every input prepared on the pool at once; the slices enqueued in input order as
        # their inputs are ready, so the device starts on the first while the rest decode.
        ready = [self._pool.submit(self._prepare, text, media, i)
                 for i, (text, media) in enumerate(parsed)]  # fmt: skip
        parts = self._slices(ready)
        if budget is not None:  # a server's request limits, placeholders counted
            parts = budget.counted(parts, len(items), None)
        try:
            with self.pipeline.slice_intake() as enqueued:
                for part in parts:
                    self.pipeline.enqueue(submission, part)
                    enqueued()
        except BaseException:
            for future in ready:
                future.cancel()
            submission.cancel()
            raise
        return submission

    def _prepare(self, text, media, index: int):
        """One input's prompt (``formatter.prompt`` of its decoded images), checked against
        max_model_len."""
        prompt = self.formatter.prompt(text, self.formatter.decode(media, index), index)
        limit = self.deployment.max_model_len
        if len(prompt.token_ids) > limit:
            raise InvalidInputError(
                f"input {index}: {len(prompt.token_ids)} tokens with its images' placeholders, "
                f"over max_model_len {limit} (inputs with images are not truncated)",
                param="input", index=index,
            )  # fmt: skip
        return prompt

    @staticmethod
    def _slices(ready: list[Future]) -> Iterator[TokenSlice]:
        """The prepared inputs as slices of :data:`SLICE_INPUTS`, in order; raises the first
        input's refusal where one was refused."""
        for first in range(0, len(ready), SLICE_INPUTS):
            prompts = [f.result() for f in ready[first : first + SLICE_INPUTS]]
            yield TokenSlice(
                first, np.concatenate([p.token_ids for p in prompts]),
                np.array([len(p.token_ids) for p in prompts], dtype=np.int64),
                media=np.concatenate([p.media for p in prompts]),
                images=[p.images for p in prompts],
            )  # fmt: skip

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def prompt_formatter(d: Deployment, limits: ImageLimits):
    """The prompt formatter of a vision-language deployment's family (``intake/vlm_inputs.py``,
    ``intake/colpali_inputs.py``): ``decode`` and ``prompt`` turn a dict input into what the
    engine enqueues."""
    family = family_of(d.folder.architecture)
    cfg = family.config(d.folder.hf_config, d.causal)
    folder, tokenizer = d.folder.path, d.folder.tokenizer_file
    if family.name == "colpali":
        return ColPaliFormatter(
            folder, tokenizer, cfg.image_token_id, limits, image_size=cfg.vision.image_size,
            patch_size=cfg.vision.patch_size,
        )  # fmt: skip
    if family.name == "colqwen2":
        return ColQwen2Formatter(folder, tokenizer, cfg.vl.image_token_id, limits)
    return VlmFormatter(folder, tokenizer, cfg.image_token_id, limits)


def open_vlm_inputs(config: EngineConfig, pipeline: Pipeline) -> VlmInputs | None:
    """Dict inputs of a vision-language checkpoint (None for every other model)."""
    if family_of(pipeline.deployment.folder.architecture).name not in VLM_FAMILIES:
        return None
    return VlmInputs(config, pipeline)


def submit_multimodal(
    vlm: VlmInputs | None,
    inputs: InputPreparer,
    items,
    *,
    pooling: str | None,
    dimensions: int | None,
    normalize: bool | None,
    truncate_prompt_tokens: int | None,
    truncation_side: str,
    prompt_name: str | None,
    long_inputs: str | None,
    budget: TokenBudget | None = None,
) -> Submission:
    """``Engine.submit`` for a call of dict inputs (texts with images); the text-only options
    are refused by name, ``pooling``, ``dimensions`` and ``normalize`` apply as for texts."""
    if vlm is None:
        raise InvalidInputError(
            f"this model ({inputs.deployment.folder.architecture}) takes no dict inputs; texts "
            "with images need a vision-language embedder (Qwen2VLForConditionalGeneration)",
            param="input",
        )
    refuse_text_options(
        "inputs with images",
        truncate_prompt_tokens=truncate_prompt_tokens,
        truncation_side=truncation_side,
        prompt_name=prompt_name,
        long_inputs=long_inputs,
    )
    items = [items] if isinstance(items, (dict, ChatPrompt)) else list(items)
    if vlm.multi_vector:  # ColQwen2 / ColPali normalise every token (False: the projection)
        if dimensions is not None:
            raise InvalidInputError(
                f"dimensions: {vlm.model_name}'s token vectors are {vlm.deployment.output_dim} "
                "wide, as the checkpoint computes them",
                param="dimensions",
            )
        normalize = True if normalize is None else normalize
    params = inputs.params(pooling or vlm.deployment.pooling, dimensions, normalize)
    return vlm.submit(items, params, budget)
