"""Turning what a caller passed into validated prompts (token ids) and pooling parameters.

Every problem is an InvalidInputError naming the field and the input, so a bad request never
reaches the scheduler and never disturbs other requests. Cheap checks come before the tokenizer
sees a text: emptiness, a length bound in characters, and whether the text is valid Unicode at
all. Inputs become token ids in slices (``token_slices``): the engine enqueues each slice as
soon as it is tokenised, so the device computes the first slice while a thread of the call's
own tokenises the next (``read_ahead``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from itertools import chain
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np

from ..config import check_long_inputs
from ..core.request import POOLING_NAMES, PoolingParams
from ..errors import InvalidInputError, PromptTooLongError
from ..loading.deployment import Deployment
from ..loading.retrieval import ColbertHead, M3Head, M3Layout
from ..models import family_of
from .eos_pooling import check_eos_last, eos_token_of
from .read_ahead import read_ahead
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .token_budget import TokenBudget

# A text longer than this many characters per token of the limit is refused (or, when
# truncation was asked for, cut to it) before it is tokenised: tokenising is the expensive part,
# and a 10 MB body would otherwise keep a worker busy for seconds only to be refused. TEI's
# bound: a token of more than 250 characters on average does not occur in real text.
MAX_CHARS_PER_TOKEN = 250
# Inputs per slice (``token_slices``): the first slice is what the device waits for before its
# first kernel; each later one, twice the last up to SLICE, is prepared while the device
# computes the steps of those before (paced by ``Engine._slice_intake``). 8192 short queries
# on an H200, passes alternated in one process (docs/benchmarks/gpu-short-inputs.md): 512 then
# 2048 each 27.8-28.1 ms a call against 28.4-29.3 for 1024 each; 512 doubling to 2048 within
# noise of 1024 doubling to 2048, and of 1024 each on a slower host; a first slice of 256 was
# 8-10% slower (its step too short to hide the next one's preparation).
FIRST_SLICE = 512
# Token-id arrays pack in bulk at ~0.3 us each (texts tokenise far slower), so their first slice
# is larger: with a step that starts an idle pipeline capped at half the budget
# (``IntakePacer.idle_step_tokens``), it holds that step and the start of the next, which the loop
# then builds while the first runs (docs/benchmarks/gpu-short-inputs.md).
FIRST_SLICE_IDS = 1024
SLICE = 2048


@dataclass(frozen=True)
class TokenSlice:
    """Prompts ``first .. first + len(lengths) - 1`` of a call, back to back."""

    first: int
    token_ids: np.ndarray  # [sum(lengths)] int64
    lengths: np.ndarray  # [n] int64
    type_ids: np.ndarray | None = None  # [sum(lengths)] int64 token types of pairs; None: all 0
    # [n] int64 keys per prompt: its first key_lens tokens are the keys of its attention (the
    # rest attend but are not attended to: ColBERT's query expansion); 0 or None: every token.
    key_lens: np.ndarray | None = None
    # Vision-language prompts (``core/media.py``): [sum(lengths), MEDIA_COLUMNS] int64 media
    # rows parallel to token_ids, and each prompt's images; None for text models.
    media: np.ndarray | None = None
    images: list | None = None

    def longest_first(self) -> tuple[TokenSlice, np.ndarray]:
        """The same prompts, longest first (ties in input order), and for each of them its
        row in this slice."""
        order = np.argsort(-self.lengths, kind="stable")
        starts = np.cumsum(self.lengths) - self.lengths
        lengths = self.lengths[order]
        # Token j of the reordered slice comes from its prompt's start plus j's place in it.
        new_starts = np.cumsum(lengths) - lengths
        take = np.repeat(starts[order] - new_starts, lengths) + np.arange(int(lengths.sum()))
        types = None if self.type_ids is None else self.type_ids[take]
        keys = None if self.key_lens is None else self.key_lens[order]
        media = None if self.media is None else self.media[take]
        images = None if self.images is None else [self.images[i] for i in order]
        reordered = TokenSlice(
            self.first, self.token_ids[take], lengths, types, keys, media, images
        )
        return reordered, order


class InputPreparer:
    """Turns a call's inputs (texts or token-id lists) into validated token slices for one
    deployment: prompt names, the character bound, tokenisation, truncation or refusal of
    inputs over ``max_model_len``, pooling parameters. Raises ``InvalidInputError`` naming
    the input; holds no per-call state, so any thread may use it.
    """

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.tokenizer = Tokenizer(deployment.folder.tokenizer_file)
        st = deployment.folder.st
        self.prompts: dict[str, str] = dict(st.prompts) if st else {}
        self.default_prompt_name = st.default_prompt_name if st else None
        folder = deployment.folder
        self.eos_pooled = eos_token_of(folder.hf_config, folder.architecture)  # CLIP's text

    # -- prompts ------------------------------------------------------------------------------

    def prepare(self, inputs, **options) -> list[np.ndarray]:
        """Token ids per input (for ``Engine.tokenize``); same options as ``token_slices``."""
        out = []
        for part in self.token_slices(inputs, **options):
            out += np.split(part.token_ids, np.cumsum(part.lengths)[:-1])
        return out

    def items(self, inputs) -> list:
        """The call's inputs as a list: a string is one input, and so is a flat list of token
        ids (as in OpenAI's API); otherwise a list of strings or of token-id lists."""
        if isinstance(inputs, str):
            return [inputs]
        if isinstance(inputs, np.ndarray) and inputs.ndim == 1 and inputs.dtype.kind in "iu":
            return [inputs]
        if not isinstance(inputs, (Sequence, np.ndarray)):
            raise InvalidInputError(
                "inputs must be a list of strings or of token-id lists, "
                f"got {type(inputs).__name__}",
                param="input",
            )
        if len(inputs) and all(_is_int(x) for x in inputs):
            return [inputs]
        return list(inputs)

    def token_slices(
        self,
        inputs,
        *,
        truncate_prompt_tokens: int | None = None,
        truncation_side: str = "right",
        prompt_name: str | None = None,
        long_inputs: str = "error",
        slice_size: int | None = None,
        budget: TokenBudget | None = None,
    ) -> Iterator[TokenSlice]:
        """Validate the options and, for texts, every input up front (empties, lengths in
        characters), then tokenise and length-check a slice at a time: ``FIRST_SLICE`` texts
        or ``FIRST_SLICE_IDS`` token-id inputs, then each slice twice the last up to ``SLICE``
        (``slice_size`` each where given).
        Token-id inputs are checked a slice at a time (in bulk where they are numpy arrays), so
        the first slice is out before the last is looked at; an error names the input either way.
        Inputs as ``items`` takes them. ``long_inputs`` (see ``EngineConfig``): "truncate"
        cuts inputs to max_model_len, "chunk" lets them through whole (the engine splits them
        into windows), "error" refuses them. ``budget``: the call held to it
        (``TokenBudget.counted``: refused before any slice is out where it is over)."""
        items = self.items(inputs)
        if len(items) == 0:
            raise InvalidInputError(
                "inputs is empty: give at least one text or token list", param="input"
            )
        limit = self._limit(truncate_prompt_tokens)
        if limit is None and check_long_inputs(long_inputs) == "truncate":
            limit = self.deployment.max_model_len
        longest = None if long_inputs == "chunk" else self.deployment.max_model_len
        if truncation_side not in ("right", "left"):
            raise InvalidInputError(
                "truncation_side must be 'right' or 'left'", param="truncation_side"
            )
        keep = "first" if truncation_side == "right" else "last"
        # The set first: no Python call per text (a str subclass takes the second test).
        if {*map(type, items)} <= {str} or all(isinstance(x, str) for x in items):
            parts = self._text_slices(items, limit, longest, keep, prompt_name, slice_size)
        elif prompt_name is not None:
            raise InvalidInputError("prompt_name applies to text inputs only", param="prompt_name")
        else:
            parts = self._id_slices(items, limit, longest, keep, slice_size)
        if budget is not None:  # counted on these slices: no tokenising of its own
            bounds = [b for b in (limit, longest) if b is not None]
            parts = budget.counted(parts, len(items), min(bounds) if bounds else None)
        yield from parts

    def _text_slices(
        self,
        texts: list[str],
        limit: int | None,
        longest: int | None,
        keep: str,
        prompt_name: str | None,
        slice_size: int | None,
    ) -> Iterator[TokenSlice]:
        """``token_slices`` of texts: all checked first, then tokenised a slice at a time, the
        next slices on threads of the call's own while the caller takes the last
        (``read_ahead``) where there are several."""
        texts = self._with_prompt(self.checked_texts(texts, limit, longest, keep), prompt_name)

        def tokenised(lo: int, hi: int) -> TokenSlice:
            flat, lengths = self.tokenizer.encode_flat(texts[lo:hi], max_tokens=limit, keep=keep)
            self._check_lengths(lo, lengths, longest)
            check_eos_last(self.eos_pooled, lo, flat, lengths)
            return TokenSlice(lo, flat, lengths)

        bounds = list(_slice_bounds(len(texts), slice_size))
        if len(bounds) == 1:
            return iter([tokenised(*bounds[0])])
        return read_ahead(partial(tokenised, lo, hi) for lo, hi in bounds)

    def _id_slices(
        self,
        items: list,
        limit: int | None,
        longest: int | None,
        keep: str,
        slice_size: int | None,
    ) -> Iterator[TokenSlice]:
        """``token_slices`` of token-id inputs, checked a slice at a time."""
        arrays = None  # every input as an array, once a slice needs the item-by-item check
        for lo, hi in _slice_bounds(len(items), slice_size, FIRST_SLICE_IDS):
            packed = None
            if arrays is None:
                part = items[lo:hi]
                packed = _pack_arrays(part) or _pack_lists(part)
            if packed is None:
                if arrays is None:  # raises naming the first bad input, if there is one
                    arrays = self._token_arrays(items)
                part = arrays[lo:hi]
                lengths = np.fromiter(map(len, part), dtype=np.int64, count=len(part))
                packed = np.concatenate(part), lengths
            flat, lengths = packed
            flat = flat.astype(np.int64, copy=False)
            self._check_vocabulary(lo, flat, lengths)
            if limit is not None and lengths.max() > limit:
                flat, lengths = _truncate_flat(flat, lengths, limit, keep)
            self._check_lengths(lo, lengths, longest)
            check_eos_last(self.eos_pooled, lo, flat, lengths)
            yield TokenSlice(lo, flat, lengths)

    def checked_texts(
        self,
        texts: list[str],
        limit: int | None,
        longest: int | None,
        keep: str = "first",
        param: str = "input",
        allow_empty: bool = False,
    ) -> list[str]:
        """Texts that may go to the tokenizer: not empty, valid Unicode (JSON's ``"\\ud800"``
        escape makes a lone surrogate, which no tokenizer takes) and, unless long inputs are
        chunked (``longest`` None), at most ``MAX_CHARS_PER_TOKEN`` per token of the limit
        (longer ones cut to that when truncating, else refused)."""
        bound = limit or longest
        max_chars = bound * MAX_CHARS_PER_TOKEN if bound is not None else None
        out = []
        for i, text in enumerate(texts):
            if not text and not allow_empty:
                raise InvalidInputError(f"{param} {i} is an empty string", param=param, index=i)
            if max_chars is not None and len(text) > max_chars:
                if limit is None:
                    raise PromptTooLongError(
                        f"{param} {i} has {len(text)} characters, more than the {max_chars} that "
                        f"max_model_len={self.deployment.max_model_len} tokens allow "
                        f"({MAX_CHARS_PER_TOKEN} per token); shorten it, or let long inputs be "
                        "truncated or chunked (long_inputs='truncate' or 'chunk'; command "
                        "line: --long-inputs)",
                        param=param,
                        index=i,
                    )
                # Far more characters than the kept tokens can come from: the cut is never
                # near them.
                text = text[:max_chars] if keep == "first" else text[len(text) - max_chars :]
            if not text.isascii():
                _check_unicode(i, text, param)
            out.append(text)
        return out

    def _token_arrays(self, items) -> list[np.ndarray]:
        """Every input as a 1-D integer array, or an error naming the first bad one, item by
        item (inputs that are all such arrays already take ``_pack_arrays``, in bulk)."""
        arrays = []
        for i, x in enumerate(items):
            if isinstance(x, str) or not isinstance(x, (Sequence, np.ndarray)):
                if i == 0 and isinstance(x, str):  # strings first: blame the first other one
                    i = next(k for k, y in enumerate(items) if not isinstance(y, str))
                found = f"input {i} is {_kind(items[i])}"
                if i > 0:
                    found += f" but input 0 is {_kind(items[0])}"
                raise InvalidInputError(
                    f"{found}: inputs must be all strings or all lists of token ids (not a mix, "
                    "not nested deeper)",
                    param="input",
                    index=i,
                )
            try:
                ids = np.asarray(x)
            except (ValueError, TypeError, OverflowError):  # ragged, nested, out of range
                ids = np.asarray(x, dtype=object)
            if ids.size == 0:
                raise InvalidInputError(f"input {i} is an empty token list", param="input", index=i)
            # numpy makes [1, True] an integer array: a bool among the ids is refused too.
            mixed_bool = not isinstance(x, np.ndarray) and bool in {*map(type, x)}
            if ids.ndim != 1 or ids.dtype.kind not in "iu" or mixed_bool:
                raise InvalidInputError(
                    f"input {i} is not a flat list of integer token ids: inputs must be all "
                    "strings or all lists of token ids (not a mix, not nested deeper)",
                    param="input",
                    index=i,
                )
            arrays.append(ids)
        return arrays

    def _check_vocabulary(self, first: int, flat: np.ndarray, lengths: np.ndarray) -> None:
        vocab = self.deployment.vocab_size
        # One pass over the ids: negative int64 ids read as uint64 are above any vocabulary.
        bad = np.flatnonzero(flat.view(np.uint64) >= vocab)
        if not len(bad):
            return
        offsets = np.cumsum(lengths)
        i = int(np.searchsorted(offsets, bad[0], side="right"))
        position = int(bad[0] - (offsets[i - 1] if i else 0))
        raise InvalidInputError(
            f"input {first + i} has token id {int(flat[bad[0]])} at position {position}, "
            f"outside the vocabulary [0, {vocab})",
            param="input",
            index=first + i,
        )

    def _limit(self, truncate: int | None) -> int | None:
        max_len = self.deployment.max_model_len
        if truncate is None:
            return None
        if (
            not isinstance(truncate, int)
            or isinstance(truncate, bool)
            or (truncate < 1 and truncate != -1)
        ):
            raise InvalidInputError(
                "truncate_prompt_tokens must be a positive integer or -1 (= max_model_len)",
                param="truncate_prompt_tokens",
            )
        if truncate == -1:
            return max_len
        if truncate > max_len:
            raise InvalidInputError(
                f"truncate_prompt_tokens={truncate} is larger than max_model_len={max_len}",
                param="truncate_prompt_tokens",
            )
        return truncate

    def _with_prompt(self, texts: list[str], prompt_name: str | None) -> list[str]:
        prefix = self.prompt_text(prompt_name)
        return [prefix + t for t in texts] if prefix else texts

    def prompt_text(self, prompt_name: str | None) -> str:
        """``prompt_text`` of this model's prompts."""
        return prompt_text(self.prompts, self.default_prompt_name, prompt_name)

    def _check_lengths(
        self,
        first: int,
        lengths: np.ndarray,
        longest: int | None,
        *,
        name: str = "input",
        param: str = "input",
    ) -> None:
        """Prompts over ``longest`` tokens (None: no cap, they are chunked) are refused, as are
        prompts a decoder's KV cache cannot hold; errors call prompt i "<name> i" and blame
        the request field ``param``."""
        d = self.deployment
        over = np.nonzero(lengths > longest)[0] if longest is not None else np.zeros(0, np.int64)
        if len(over):
            i = int(over[0])
            raise PromptTooLongError(
                f"{name} {first + i} has {int(lengths[i])} tokens, more than "
                f"max_model_len={d.max_model_len}; shorten it, or let long inputs be truncated "
                "or chunked (long_inputs='truncate' or 'chunk'; command line: --long-inputs)",
                param=param,
                index=first + i,
            )
        if d.causal and longest is not None:
            over = np.nonzero(lengths > d.kv_cache_tokens)[0]
            if len(over):
                i = int(over[0])
                raise PromptTooLongError(
                    f"{name} {first + i} has {int(lengths[i])} tokens but the KV cache holds "
                    f"{d.kv_cache_tokens}",
                    param=param,
                    index=first + i,
                )

    @cached_property
    def takes_key_lengths(self) -> bool:
        """Whether the model's attention honours key lengths (``key_lengths``)."""
        d = self.deployment
        return family_of(d.folder.architecture).honours_key_lengths(d.folder.hf_config, d.causal)

    def key_lengths(self, key_lens, lengths: np.ndarray) -> np.ndarray:
        """``key_lens`` (one per prompt of ``lengths``) as an int64 array, checked: each in
        [1, its prompt's length], or 0 for every token; refused unless the model's attention
        honours them (bidirectional: BERT, RoBERTa / XLM-R, DistilBERT, ELECTRA, ModernBERT,
        bidirectional Qwen / Llama-style decoders; not MPNet, DeBERTa, T5, Gemma)."""
        d = self.deployment
        if not self.takes_key_lengths:
            kind = "causal" if d.causal else d.folder.architecture
            raise InvalidInputError(
                f"key lengths (query expansion tokens that are not attended to) are not "
                f"supported by this model ({kind} attention)",
                param="key_lens",
            )
        keys = np.asarray(key_lens)
        if keys.shape != lengths.shape or (keys.size and keys.dtype.kind not in "iu"):
            raise InvalidInputError(
                f"key_lens must be {len(lengths)} integers, one per prompt", param="key_lens"
            )
        keys = keys.astype(np.int64, copy=False)
        bad = np.flatnonzero((keys < 0) | (keys > lengths))
        if len(bad):
            i = int(bad[0])
            raise InvalidInputError(
                f"input {i} has key length {int(keys[i])}, outside [1, {int(lengths[i])}] "
                "(its length; 0: every token is a key)",
                param="key_lens",
                index=i,
            )
        return keys

    # -- pooling parameters -------------------------------------------------------------------

    def params(self, pooling: str, dimensions: int | None, normalize: bool | None) -> PoolingParams:
        """``pooling_params`` for this deployment."""
        d = self.deployment
        width = self.output_width(pooling) if pooling in POOLING_NAMES else 0
        return pooling_params(pooling, dimensions, normalize, width=width, default=d.normalize)

    def output_width(self, pooling: str) -> int:
        """Components of one output vector before Matryoshka truncation."""
        return output_width(self.deployment, pooling)


def pooling_params(
    pooling: str, dimensions: int | None, normalize: bool | None, *, width: int, default: bool
) -> PoolingParams:
    """A call's pooling parameters, checked: ``pooling`` one of ``POOLING_NAMES``,
    ``dimensions`` (Matryoshka) at most ``width`` (the output's size under that pooling);
    ``normalize`` None: ``default`` (the model's), except for token embeddings (never)."""
    if pooling not in POOLING_NAMES:
        raise InvalidInputError(
            f"pooling must be one of {POOLING_NAMES}, got {pooling!r}", param="pooling"
        )
    if dimensions is not None:
        if not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1:
            raise InvalidInputError("dimensions must be a positive integer", param="dimensions")
        if dimensions > width:
            raise InvalidInputError(
                f"dimensions={dimensions} is larger than the model's embedding size {width}",
                param="dimensions",
            )
    if normalize is None:
        normalize = default if pooling != "all" else False
    return PoolingParams(pooling=pooling, normalize=bool(normalize), dimensions=dimensions)


def prompt_text(prompts: Mapping[str, str], default_name: str | None, name: str | None) -> str:
    """The text put before each input: the prompt ``name``, else the model's default prompt
    (``default_name``), else none (""). Raises InvalidInputError for a name not in
    ``prompts``."""
    name = name if name is not None else default_name
    if name is None:
        return ""
    if name not in prompts:
        known = ", ".join(sorted(prompts)) or "none"
        raise InvalidInputError(
            f"unknown prompt_name {name!r} (this model has: {known})", param="prompt_name"
        )
    return prompts[name]


def valid_texts(
    texts: Sequence[str],
    *,
    max_tokens: int | None = None,
    param: str = "input",
    allow_empty: bool = False,
) -> list[str]:
    """Texts any tokenizer takes: valid Unicode (JSON's ``"\\ud800"`` escape makes a lone
    surrogate, which no tokenizer takes), not empty unless ``allow_empty``; where the tokens
    kept are bounded (``max_tokens``), each cut to ``MAX_CHARS_PER_TOKEN`` characters a token,
    far beyond where its kept tokens can end. Errors name text i "``param`` i"."""
    max_chars = max_tokens * MAX_CHARS_PER_TOKEN if max_tokens is not None else None
    out = []
    for i, text in enumerate(texts):
        if not text and not allow_empty:
            raise InvalidInputError(f"{param} {i} is an empty string", param=param, index=i)
        if max_chars is not None and len(text) > max_chars:
            text = text[:max_chars]
        if not text.isascii():
            _check_unicode(i, text, param)
        out.append(text)
    return out


def output_width(d: Deployment, pooling: str) -> int:
    """Components of one output vector of ``d`` under ``pooling``, before Matryoshka
    truncation."""
    if pooling != "all" or (d.classifier is not None and d.classifier.per_token):
        return d.output_dim
    head = d.retrieval
    if isinstance(head, M3Head):  # token rows packed as M3Layout says
        return M3Layout(d.hidden_size, head.colbert_dim).row_width
    if isinstance(head, ColbertHead):  # the projections' width
        return head.dense[-1].out_features if head.dense else d.hidden_size
    return d.hidden_size


def _slice_bounds(n: int, size: int | None, first: int | None = None) -> Iterator[tuple[int, int]]:
    """``[lo, hi)`` of each slice of ``n`` inputs: ``size`` each where given, else ``first``
    (``FIRST_SLICE`` unless given), then each twice the last up to ``SLICE``."""
    lo, step = 0, size or first or FIRST_SLICE
    while lo < n:
        yield lo, min(lo + step, n)
        lo += step
        step = size or min(2 * step, SLICE)


def _pack_arrays(part: list) -> tuple[np.ndarray, np.ndarray] | None:
    """(ids back to back, lengths) of inputs that are all non-empty 1-D integer numpy arrays
    (the common programmatic call), checked in bulk: a call of thousands of prompts must not
    cost microseconds each, and the device waits for the first slice. None where any input is
    something else: the item-by-item check then takes them (lists, or an error naming one)."""
    if set(map(type, part)) != {np.ndarray}:
        return None
    if any(dtype.kind not in "iu" for dtype in set(map(_DTYPE, part))):
        return None
    try:
        lengths = np.fromiter(map(len, part), dtype=np.int64, count=len(part))  # 0-d: TypeError
        flat = np.concatenate(part)  # arrays of different dimensions: ValueError
    except (TypeError, ValueError):
        return None
    if flat.ndim != 1 or lengths.min() == 0:  # all of them 2-D, or an empty one
        return None
    return flat, lengths


def _pack_lists(part: list) -> tuple[np.ndarray, np.ndarray] | None:
    """(ids back to back, lengths) of inputs that are all non-empty lists or tuples of Python
    ints (token ids as JSON bodies and users' lists give them), checked in bulk by the set of
    their ids' types: one C-level pass, where the item-by-item check makes Python calls an
    input; no bool, float or string is taken for an id. None where any input is something
    else: the item-by-item check then takes them (or names the bad one)."""
    if not {*map(type, part)} <= {list, tuple}:
        return None
    if {*map(type, chain.from_iterable(part))} != {int}:  # also: all of them empty
        return None
    lengths = np.fromiter(map(len, part), dtype=np.int64, count=len(part))
    if lengths.min() == 0:
        return None
    try:
        flat = np.fromiter(chain.from_iterable(part), dtype=np.int64, count=int(lengths.sum()))
    except OverflowError:  # an id past int64: the item-by-item check refuses it
        return None
    return flat, lengths


_DTYPE = attrgetter("dtype")


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_unicode(i: int, text: str, param: str = "input") -> None:
    """InvalidInputError naming the first character UTF-8 cannot encode (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        raise InvalidInputError(
            f"{param} {i} is not valid Unicode: character {exc.start} is U+{code:04X}, a lone "
            "surrogate (half of a UTF-16 pair); send the text as valid UTF-8",
            param=param,
            index=i,
        ) from None


def _truncate_flat(
    flat: np.ndarray, lengths: np.ndarray, limit: int, keep: str
) -> tuple[np.ndarray, np.ndarray]:
    """Token-id prompts cut to ``limit`` tokens (no special tokens to keep: ids are the
    caller's own)."""
    parts = np.split(flat, np.cumsum(lengths)[:-1])
    cut = [p[:limit] if keep == "first" else p[len(p) - limit :] for p in parts]
    return np.concatenate(cut), np.minimum(lengths, limit)


def _kind(x) -> str:
    if isinstance(x, str):
        return "a string"
    if isinstance(x, (Sequence, np.ndarray)):
        return "a token list"
    return f"a {type(x).__name__}"
