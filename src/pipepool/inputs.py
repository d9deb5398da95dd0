"""Turning what a caller passed into validated prompts (token ids) and pooling parameters.

Every problem is an InvalidInputError naming the field and the input, so a bad request never
reaches the scheduler and never disturbs other requests. Cheap checks come before the tokenizer
sees a text: emptiness, a length bound in characters, and whether the text is valid Unicode at
all. Inputs become token ids in slices (``token_slices``): the engine enqueues each slice as
soon as it is tokenised, so the device computes the first slice while the caller's thread
tokenises the next.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .core.request import POOLING_NAMES, PoolingParams
from .deployment import Deployment
from .errors import InvalidInputError, PromptTooLongError
from .tokenizer import Tokenizer

# A text longer than this many characters per token of the limit is refused (or, when
# truncation was asked for, cut to it) before it is tokenised: tokenising is the expensive part,
# and a 10 MB body would otherwise keep a worker busy for seconds only to be refused. TEI's
# bound: a token of more than 250 characters on average does not occur in real text.
MAX_CHARS_PER_TOKEN = 250


@dataclass(frozen=True)
class TokenSlice:
    """Prompts ``first .. first + len(lengths) - 1`` of a call, back to back."""

    first: int
    token_ids: np.ndarray  # [sum(lengths)] int64
    lengths: np.ndarray  # [n] int64


class InputPreparer:
    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.tokenizer = Tokenizer(deployment.folder.tokenizer_file)
        st = deployment.folder.st
        self.prompts: dict[str, str] = dict(st.prompts) if st else {}
        self.default_prompt_name = st.default_prompt_name if st else None

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
        slice_size: int = 1024,
    ) -> Iterator[TokenSlice]:
        """Validate every input up front (types, empties, lengths in characters, options),
        then tokenise and length-check ``slice_size`` inputs at a time. Inputs as ``items``
        takes them."""
        items = self.items(inputs)
        if len(items) == 0:
            raise InvalidInputError(
                "inputs is empty: give at least one text or token list", param="input"
            )
        limit = self._limit(truncate_prompt_tokens)
        if truncation_side not in ("right", "left"):
            raise InvalidInputError(
                "truncation_side must be 'right' or 'left'", param="truncation_side"
            )
        keep = "first" if truncation_side == "right" else "last"
        if all(isinstance(x, str) for x in items):
            texts = self._with_prompt(self._checked_texts(items, limit, keep), prompt_name)
            for lo in range(0, len(texts), slice_size):
                flat, lengths = self.tokenizer.encode_flat(
                    texts[lo : lo + slice_size], max_tokens=limit, keep=keep
                )
                self._check_lengths(lo, lengths, truncating=limit is not None)
                yield TokenSlice(lo, flat, lengths)
            return
        if prompt_name is not None:
            raise InvalidInputError("prompt_name applies to text inputs only", param="prompt_name")
        flat, lengths = self._token_lists(items)
        if limit is not None and len(lengths) and lengths.max() > limit:
            flat, lengths = _truncate_flat(flat, lengths, limit, keep)
        self._check_lengths(0, lengths, truncating=limit is not None)
        yield TokenSlice(0, flat, lengths)

    def _checked_texts(self, texts: list[str], limit: int | None, keep: str) -> list[str]:
        """Texts that may go to the tokenizer: not empty, at most ``MAX_CHARS_PER_TOKEN`` per
        token of the limit (longer ones cut to that when truncating, else refused), and valid
        Unicode (JSON's ``"\\ud800"`` escape makes a lone surrogate, which no tokenizer takes).
        """
        max_chars = (limit or self.deployment.max_model_len) * MAX_CHARS_PER_TOKEN
        out = []
        for i, text in enumerate(texts):
            if not text:
                raise InvalidInputError(f"input {i} is an empty string", param="input")
            if len(text) > max_chars:
                if limit is None:
                    raise PromptTooLongError(
                        f"input {i} has {len(text)} characters, more than the {max_chars} that "
                        f"max_model_len={self.deployment.max_model_len} tokens allow "
                        f"({MAX_CHARS_PER_TOKEN} per token); shorten it or pass "
                        "truncate_prompt_tokens",
                        param="input",
                    )
                # Far more characters than the kept tokens can come from: the cut is never
                # near them.
                text = text[:max_chars] if keep == "first" else text[len(text) - max_chars :]
            if not text.isascii():
                _check_unicode(i, text)
            out.append(text)
        return out

    def _token_lists(self, items) -> tuple[np.ndarray, np.ndarray]:
        arrays = []
        for i, x in enumerate(items):
            if isinstance(x, str) or not isinstance(x, (Sequence, np.ndarray)):
                raise InvalidInputError(
                    "inputs must be all strings or all lists of token ids "
                    "(not a mix, not nested deeper)",
                    param="input",
                )
            try:
                ids = np.asarray(x)
            except (ValueError, TypeError, OverflowError):  # ragged, nested, out of range
                ids = np.asarray(x, dtype=object)
            if ids.size == 0:
                raise InvalidInputError(f"input {i} is an empty token list", param="input")
            if ids.ndim != 1 or ids.dtype.kind not in "iu":
                raise InvalidInputError(
                    f"input {i} is not a flat list of integer token ids: inputs must be all "
                    "strings or all lists of token ids (not a mix, not nested deeper)",
                    param="input",
                )
            arrays.append(ids)
        lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
        flat = np.concatenate(arrays).astype(np.int64, copy=False)
        vocab = self.deployment.vocab_size
        bad = np.nonzero((flat < 0) | (flat >= vocab))[0]
        if len(bad):
            offsets = np.cumsum(lengths)
            i = int(np.searchsorted(offsets, bad[0], side="right"))
            position = int(bad[0] - (offsets[i - 1] if i else 0))
            raise InvalidInputError(
                f"input {i} has token id {int(flat[bad[0]])} at position {position}, "
                f"outside the vocabulary [0, {vocab})",
                param="input",
            )
        return flat, lengths

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
        name = prompt_name if prompt_name is not None else self.default_prompt_name
        if name is None:
            return texts
        if name not in self.prompts:
            known = ", ".join(sorted(self.prompts)) or "none"
            raise InvalidInputError(
                f"unknown prompt_name {name!r} (this model has: {known})", param="prompt_name"
            )
        prefix = self.prompts[name]
        return [prefix + t for t in texts]

    def _check_lengths(self, first: int, lengths: np.ndarray, *, truncating: bool) -> None:
        d = self.deployment
        over = np.nonzero(lengths > d.max_model_len)[0]
        if len(over):
            i = int(over[0])
            raise PromptTooLongError(
                f"input {first + i} has {int(lengths[i])} tokens, more than "
                f"max_model_len={d.max_model_len}; shorten it or pass truncate_prompt_tokens",
                param="input",
            )
        if d.causal:
            over = np.nonzero(lengths > d.kv_cache_tokens)[0]
            if len(over):
                i = int(over[0])
                raise PromptTooLongError(
                    f"input {first + i} has {int(lengths[i])} tokens but the KV cache holds "
                    f"{d.kv_cache_tokens}",
                    param="input",
                )

    # -- pooling parameters -------------------------------------------------------------------

    def params(self, pooling: str, dimensions: int | None, normalize: bool | None) -> PoolingParams:
        d = self.deployment
        if pooling not in POOLING_NAMES:
            raise InvalidInputError(
                f"pooling must be one of {POOLING_NAMES}, got {pooling!r}", param="pooling"
            )
        if dimensions is not None:
            if not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1:
                raise InvalidInputError("dimensions must be a positive integer", param="dimensions")
            if dimensions > self.output_width(pooling):
                raise InvalidInputError(
                    f"dimensions={dimensions} is larger than the model's embedding size "
                    f"{self.output_width(pooling)}",
                    param="dimensions",
                )
        if normalize is None:
            normalize = d.normalize if pooling != "all" else False
        return PoolingParams(pooling=pooling, normalize=bool(normalize), dimensions=dimensions)

    def output_width(self, pooling: str) -> int:
        """Components of one output vector before Matryoshka truncation."""
        d = self.deployment
        return d.hidden_size if pooling == "all" else d.output_dim


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_unicode(i: int, text: str) -> None:
    """InvalidInputError naming the first character UTF-8 cannot encode (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        raise InvalidInputError(
            f"input {i} is not valid Unicode: character {exc.start} is U+{code:04X}, a lone "
            "surrogate (half of a UTF-16 pair); send the text as valid UTF-8",
            param="input",
        ) from None


def _truncate_flat(
    flat: np.ndarray, lengths: np.ndarray, limit: int, keep: str
) -> tuple[np.ndarray, np.ndarray]:
    """Token-id prompts cut to ``limit`` tokens (no special tokens to keep: ids are the
    caller's own)."""
    parts = np.split(flat, np.cumsum(lengths)[:-1])
    cut = [p[:limit] if keep == "first" else p[len(p) - limit :] for p in parts]
    return np.concatenate(cut), np.minimum(lengths, limit)
