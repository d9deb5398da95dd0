"""sentence-transformers' ``SentenceTransformer`` as an adapter over an ``Engine``, with its
semantics, so code written for it runs on the engine unchanged: ``encode`` / ``encode_query`` /
``encode_document``, ``similarity`` / ``similarity_pairwise``, and the attributes
``similarity_fn_name`` and ``truncate_dim``; the attributes it shares with the ``CrossEncoder``
adapter (``prompts``, ``default_prompt_name``, ``max_seq_length``, ``tokenizer``, ``device``) are
``st_attributes.STAdapter``'s.

These calls tokenize as sentence-transformers does (prompt prepended to the text, cut to
``max_seq_length`` with the special tokens kept, an empty text embedded as its special tokens
alone) and hand the engine token ids; everything else (the model's own heads, Normalize
included) runs in the engine. A folder without sentence-transformers modules is embedded as
``SentenceTransformer`` builds it (``_st_pooling``). Deliberate differences: ``encode([])``
is a ``[0, dim]`` array (sentence-transformers gives a ``[0]`` float64 one), and the engine
computes where it was started (``device=`` may only name that place).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from ..core.dual_encoders import DUAL_ENCODERS
from ..errors import InvalidInputError
from ..intake.images import image_inputs
from ..intake.inputs import FIRST_SLICE, SLICE, valid_texts
from ..intake.read_ahead import read_ahead
from .encode_output import check_ranges, cut, encode_output, quantizer
from .engine import Engine
from .int8_scale import Int8Calibration
from .progress import follow
from .quantization import PRECISIONS
from .st_attributes import STAdapter, check_batch_size, refuse_unknown, renamed

if TYPE_CHECKING:
    from ..core.submission import Submission
    from ..intake.long_inputs import CombinedSubmission

log = logging.getLogger("pipepool")

# The prompts encode_query and encode_document apply when a call names none: the first of
# these names the model has (sentence-transformers' rule).
TASK_PROMPTS = {"query": ("query",), "document": ("document", "passage", "corpus")}
OUTPUT_VALUES = ("sentence_embedding", "token_embeddings")
SIMILARITIES = ("cosine", "dot", "euclidean", "manhattan")


class SentenceTransformer(STAdapter):
    """sentence-transformers' ``SentenceTransformer`` over an ``Engine``: its methods and
    attributes with its semantics. ``SentenceTransformer(model, **options)`` starts and owns an
    Engine (``options``: ``EngineConfig`` fields, ``device`` among them);
    ``SentenceTransformer(engine)`` shares one (``STAdapter``). ``prompts``,
    ``default_prompt_name``, ``similarity_fn_name`` and ``truncate_dim`` are set as
    sentence-transformers' constructor sets them (else the folder's). Bad options raise
    ``InvalidInputError`` (a ``ValueError``, as sentence-transformers raises)."""

    def __init__(
        self,
        model_name_or_path: str | os.PathLike[str] | Engine | None = None,
        *,
        prompts: dict[str, str] | None = None,
        default_prompt_name: str | None = None,
        similarity_fn_name: Any = None,
        truncate_dim: int | None = None,
        **engine_options: Any,
    ) -> None:
        super().__init__(model_name_or_path, **engine_options)
        try:
            if prompts is not None:  # sentence-transformers: the given ones over the folder's
                self.prompts = {**self.prompts, **prompts}
            if default_prompt_name is not None:
                if default_prompt_name not in self.prompts:
                    raise InvalidInputError(
                        f"Default prompt name {default_prompt_name!r} not found in the "
                        f"configured prompts dictionary with keys {list(self.prompts)!r}",
                        param="default_prompt_name",
                    )
                self.default_prompt_name = default_prompt_name
            if similarity_fn_name is not None:
                self.similarity_fn_name = similarity_fn_name
            if truncate_dim is not None:
                self.truncate_dim = truncate_dim
        except BaseException:
            self.close()
            raise
        self._int8 = Int8Calibration()  # encode's own kinds of vector

    def encode(
        self,
        inputs: str | Sequence[str] | None = None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        output_value: str | None = "sentence_embedding",
        precision: str = "float32",
        convert_to_numpy: bool = True,
        convert_to_tensor: bool = False,
        device: Any = None,
        normalize_embeddings: bool = False,
        truncate_dim: int | None = None,
        pool: Any = None,
        chunk_size: int | None = None,
        *,
        ranges: Any = "model",
        **kwargs: Any,
    ) -> Any:
        """``SentenceTransformer.encode``: by default a ``[n, dim]`` float32 array (a ``[dim]``
        vector for one string); ``convert_to_tensor``: a tensor; ``convert_to_numpy=False``: a
        list of 1-D tensors; ``output_value="token_embeddings"``: a ``[len, hidden]`` tensor per
        input. The model's heads (Normalize included) run in the engine; ``truncate_dim``
        (default: ``self.truncate_dim``) then cuts the vectors and ``normalize_embeddings``
        normalises what is left; ``precision`` quantizes. int8/uint8 follow ``ranges``
        (pipepool's): ``"model"`` (default) the model's fixed symmetric scale
        (``api/int8_scale.py``: a text's integers do not depend on the rest of the call);
        ``"call"`` sentence-transformers' own rule, buckets over each dimension's range in this
        call's vectors (what ``SentenceTransformer.encode`` gives); a ``[2, dim]`` array,
        buckets over those ranges (``quantize_embeddings``' ``ranges``). binary/ubinary pack
        the signs, as there. Inputs over ``max_seq_length`` are truncated, as there, whatever
        the engine's ``long_inputs`` (``embed`` follows that).
        ``batch_size`` is checked and otherwise unused (the engine batches by tokens);
        ``chunk_size`` is unused."""
        inputs = renamed(kwargs, "sentences", inputs)
        kwargs.pop("task", None)  # routes a Router module's input; the engine has none
        refuse_unknown(kwargs, "encode")
        if show_progress_bar is None:
            show_progress_bar = log.getEffectiveLevel() in (logging.INFO, logging.DEBUG)
        if convert_to_tensor:
            convert_to_numpy = False
        if output_value != "sentence_embedding":
            convert_to_tensor = convert_to_numpy = False
        check_batch_size(batch_size)
        single = _is_single(inputs)
        batch = [inputs] if single else inputs
        images = image_inputs(batch)  # a PIL image, bytes or a Path each: ST 6's image modality
        texts = _texts(batch) if images is None else []
        _check_choice(precision, PRECISIONS, "precision")
        check_ranges(ranges, precision)
        if output_value not in OUTPUT_VALUES:
            raise InvalidInputError(
                f"output_value must be one of {', '.join(OUTPUT_VALUES)}; got {output_value!r} "
                "(None, every intermediate feature of a padded batch, is not offered)",
                param="output_value",
            )
        self._check_device(device, pool)
        tokens = output_value == "token_embeddings"
        pooling, normalize = ("all", False) if tokens else self._st_pooling()
        if images is not None:  # a dual encoder's images (api/images.py): no prompt applies
            for name, given in (("prompt", prompt), ("prompt_name", prompt_name)):
                if given is not None:
                    raise InvalidInputError(f"{name} applies to texts, not images", param=name)
            computed = self.engine.submit(images, pooling=pooling, normalize=normalize).result()
        else:
            prefix = self._resolve_prompt(prompt, prompt_name)
            if prefix:
                texts = [prefix + text for text in texts]
            computed = self._embed_texts(texts, pooling, normalize, show_progress_bar)
        dim = truncate_dim if truncate_dim is not None else self.truncate_dim
        if tokens:
            embeddings: list | torch.Tensor = [torch.from_numpy(a) for a in computed]
        else:
            embeddings = cut(torch.from_numpy(np.asarray(computed)), dim, normalize_embeddings)
        quantize = quantizer(
            self.engine, self._int8, precision, ranges,
            (pooling, normalize, tokens, dim, normalize_embeddings),
        )  # fmt: skip
        out = encode_output(embeddings, precision, quantize, convert_to_numpy, convert_to_tensor)
        return out[0] if single else out

    def encode_query(
        self,
        inputs: str | Sequence[str] | None = None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """``encode`` with the model's ``query`` prompt when the call names none (the other
        arguments are ``encode``'s, in its order)."""
        if prompt_name is None and prompt is None:
            prompt_name = task_prompt_name(self.prompts, "query")
        return self.encode(inputs, prompt_name, prompt, *args, task="query", **kwargs)

    def encode_document(
        self,
        inputs: str | Sequence[str] | None = None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """``encode`` with the first of the model's ``document``, ``passage``, ``corpus``
        prompts when the call names none (the other arguments are ``encode``'s)."""
        if prompt_name is None and prompt is None:
            prompt_name = task_prompt_name(self.prompts, "document")
        return self.encode(inputs, prompt_name, prompt, *args, task="document", **kwargs)

    @property
    def similarity_fn_name(self) -> str:
        """cosine | dot | euclidean | manhattan: the folder's, else cosine."""
        if self._st.similarity_fn_name is None:
            self._st.similarity_fn_name = "cosine"
        return self._st.similarity_fn_name

    @similarity_fn_name.setter
    def similarity_fn_name(self, value: Any) -> None:
        value = getattr(value, "value", value)  # sentence-transformers' SimilarityFunction
        if value is not None:
            _check_choice(value, SIMILARITIES, "similarity_fn_name")
        self._st.similarity_fn_name = value

    def similarity(self, embeddings1: Any, embeddings2: Any) -> torch.Tensor:
        """``[len(embeddings1), len(embeddings2)]`` scores by ``similarity_fn_name``, a float32
        tensor computed as sentence-transformers does (negated distances for euclidean and
        manhattan, so that larger is always more similar); 1-D inputs count as one row."""
        a, b = _as_tensor(embeddings1), _as_tensor(embeddings2)
        a = a.unsqueeze(0) if a.dim() == 1 else a
        b = b.unsqueeze(0) if b.dim() == 1 else b
        name = self.similarity_fn_name
        if name == "cosine":
            return torch.mm(F.normalize(a, p=2, dim=1), F.normalize(b, p=2, dim=1).T)
        if name == "dot":
            return torch.mm(a, b.T)
        return -torch.cdist(a, b, p=2.0 if name == "euclidean" else 1.0)

    def similarity_pairwise(self, embeddings1: Any, embeddings2: Any) -> torch.Tensor:
        """``[n]`` scores of ``embeddings1[i]`` with ``embeddings2[i]``, as ``similarity``."""
        a, b = _as_tensor(embeddings1), _as_tensor(embeddings2)
        name = self.similarity_fn_name
        if name == "cosine":
            return (F.normalize(a, p=2, dim=1) * F.normalize(b, p=2, dim=1)).sum(dim=-1)
        if name == "dot":
            return (a * b).sum(dim=-1)
        if name == "euclidean":
            return -torch.sqrt(torch.sum((a - b) ** 2, dim=-1))
        return -torch.sum(torch.abs(a - b), dim=-1)

    @property
    def truncate_dim(self) -> int | None:
        """Components ``encode`` keeps of a sentence embedding (None: all), unless a call says."""
        return self._st.truncate_dim

    @truncate_dim.setter
    def truncate_dim(self, value: int | None) -> None:
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise InvalidInputError(
                f"truncate_dim must be a positive integer or None, got {value!r}",
                param="truncate_dim",
            )
        self._st.truncate_dim = value

    def get_embedding_dimension(self) -> int:
        """Size of one ``encode`` vector: after any Dense head, cut to ``truncate_dim``."""
        dim = self.engine.info.dimensions
        return dim if self.truncate_dim is None else min(dim, self.truncate_dim)

    get_sentence_embedding_dimension = get_embedding_dimension  # its name before version 6

    # -- computing ------------------------------------------------------------------------------

    def _st_pooling(self) -> tuple[str | None, bool | None]:
        """(pooling, normalize) of a sentence embedding; None: the engine's. A folder without
        sentence-transformers modules gets what ``SentenceTransformer`` builds for it (mean
        pooling, the last token for a causal LM, no Normalize), where the engine's own default
        is the family's pooling, normalized; options the Engine was started with win."""
        info, config = self.engine.info, self.engine.config
        if info.sentence_transformers:
            return None, None
        if info.architecture in DUAL_ENCODERS:  # its towers' features, as ST 6 builds them
            return None, bool(config.normalize)
        causal_lm = info.architecture.endswith("ForCausalLM")
        causal_lm = causal_lm and info.hf_config.get("is_causal", True) is not False
        pooling = config.pooling or ("last" if causal_lm else "mean")
        return pooling, bool(config.normalize)

    def _embed_texts(
        self,
        texts: list[str],
        pooling: str | None,
        normalize: bool | None,
        show_progress_bar: bool,
    ) -> np.ndarray | list[np.ndarray]:
        """The engine's output per text (``[n, dim]`` or a ``[len, hidden]`` array each), from
        token ids tokenized as sentence-transformers does. A slice at a time, the next ones
        tokenised on threads of their own (``read_ahead``) while this thread enqueues the
        last: the engine starts on the first slice while the next are tokenised."""
        limit = self.max_seq_length
        texts = valid_texts(texts, max_tokens=limit, allow_empty=True)
        tokenizer = self.engine.tokenizer

        def tokenised(lo: int, hi: int) -> list[np.ndarray]:
            flat, lengths = tokenizer.encode_flat(texts[lo:hi], max_tokens=limit)
            empty = np.flatnonzero(lengths == 0)
            if len(empty):
                raise InvalidInputError(
                    f"input {lo + int(empty[0])} has no tokens (an empty or blank text, and this "
                    "model's tokenizer adds no special tokens): there is nothing to embed",
                    param="input",
                    index=lo + int(empty[0]),
                )
            return np.split(flat, np.cumsum(lengths)[:-1])

        bounds = []
        lo, size = 0, FIRST_SLICE
        while lo < len(texts):
            bounds.append((lo, min(lo + size, len(texts))))
            lo, size = lo + size, SLICE
        slices = (
            read_ahead(partial(tokenised, lo, hi) for lo, hi in bounds)
            if len(bounds) > 1
            else (tokenised(lo, hi) for lo, hi in bounds)
        )
        parts: list[Submission | CombinedSubmission] = []
        try:
            for ids in slices:
                parts.append(
                    self.engine.submit(
                        ids, pooling=pooling, normalize=normalize, long_inputs="truncate"
                    )
                )
        except BaseException:
            for part in parts:
                part.cancel()
            raise
        if not parts:
            return (
                [] if pooling == "all" else np.zeros((0, self.engine.info.dimensions), np.float32)
            )
        follow(_Calls(parts), disable=not show_progress_bar, desc="Batches")
        results = [part.result() for part in parts]
        if pooling == "all":
            return [array for result in results for array in result]
        return np.concatenate(results)


class _Calls:
    """The submissions of one ``encode`` call seen as one by ``progress.follow``."""

    def __init__(self, parts: list[Submission | CombinedSubmission]) -> None:
        self.parts = parts
        self.num_inputs = sum(part.num_inputs for part in parts)

    @property
    def num_done(self) -> int:
        return sum(part.num_done for part in self.parts)

    def add_progress_callback(self, fn: Callable[[int], None]) -> None:
        for part in self.parts:
            part.add_progress_callback(fn)

    def exception(self) -> BaseException | None:
        for part in self.parts:
            exc = part.exception()
            if exc is not None:
                return exc
        return None


def task_prompt_name(prompts: Mapping[str, str], task: str) -> str | None:
    """The prompt ``encode_query`` (``task="query"``) or ``encode_document`` (``"document"``)
    applies when a call names none: the first of ``TASK_PROMPTS[task]`` in ``prompts``."""
    return next((name for name in TASK_PROMPTS[task] if name in prompts), None)


# -- argument handling as sentence-transformers does it -----------------------------------------


def _is_single(inputs: Any) -> bool:
    """``SentenceTransformer.is_singular_input`` for text: lists, tuples and string arrays are
    batches, anything else (a string) one input."""
    if isinstance(inputs, (list, tuple)):
        return False
    return not (isinstance(inputs, np.ndarray) and inputs.ndim >= 1 and inputs.dtype.kind in "UO")


def _texts(inputs: Any) -> list[str]:
    items = inputs.tolist() if isinstance(inputs, np.ndarray) else list(inputs)
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise InvalidInputError(
                f"input {i} is a {type(item).__name__}: pipepool embeds text (strings)",
                param="input",
                index=i,
            )
    return items


def _check_choice(value: Any, choices: tuple[str, ...], name: str) -> None:
    if value not in choices:
        raise InvalidInputError(
            f"{name} must be one of {', '.join(choices)}; got {value!r}", param=name
        )


def _as_tensor(embeddings: Any) -> torch.Tensor:
    """sentence-transformers' ``_convert_to_float_tensor``: arrays viewed, lists stacked,
    floats below 32 bits widened."""
    if isinstance(embeddings, list):
        if embeddings and all(isinstance(e, torch.Tensor) for e in embeddings):
            tensor = torch.stack(embeddings)
        elif embeddings and all(isinstance(e, np.ndarray) for e in embeddings):
            tensor = torch.stack([torch.from_numpy(np.asarray(e)) for e in embeddings])
        else:
            tensor = torch.tensor(embeddings)
    elif isinstance(embeddings, np.ndarray):
        tensor = (
            torch.from_numpy(embeddings) if embeddings.flags.writeable else torch.tensor(embeddings)
        )
    elif isinstance(embeddings, torch.Tensor):
        tensor = embeddings
    else:
        tensor = torch.tensor(embeddings)
    if torch.is_floating_point(tensor) and torch.finfo(tensor.dtype).bits < 32:
        tensor = tensor.float()
    return tensor
