"""Turning what a caller passed into validated prompts (token ids) and pooling parameters.

Every problem is an InvalidInputError naming the field, raised before anything is queued, so
a bad request never reaches the scheduler and never disturbs other requests.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .deployment import Deployment
from .errors import InvalidInputError, PromptTooLongError
from .request import PoolingParams
from .tokenizer import Tokenizer

_POOLINGS = ("last", "mean", "cls", "all")


class InputPreparer:
    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.tokenizer = Tokenizer(deployment.folder.tokenizer_file)
        st = deployment.folder.st
        self.prompts: dict[str, str] = dict(st.prompts) if st else {}
        self.default_prompt_name = st.default_prompt_name if st else None

    # -- prompts ------------------------------------------------------------------------------

    def prepare(
        self,
        inputs,
        *,
        truncate_prompt_tokens: int | None = None,
        truncation_side: str = "right",
        prompt_name: str | None = None,
    ) -> list[np.ndarray]:
        """Token ids per input: a list of strings, or a list of token-id lists (a single
        string is one input)."""
        items = [inputs] if isinstance(inputs, str) else inputs
        if not isinstance(items, Sequence) and not isinstance(items, np.ndarray):
            raise InvalidInputError(
                "inputs must be a list of strings or of token-id lists, "
                f"got {type(inputs).__name__}",
                param="input",
            )
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
            texts = self._with_prompt(list(items), prompt_name)
            for i, text in enumerate(items):
                if not text:
                    raise InvalidInputError(f"input {i} is an empty string", param="input")
            ids = self.tokenizer.encode_batch(texts, max_tokens=limit, keep=keep)
        elif all(_is_token_list(x) for x in items):
            if prompt_name is not None:
                raise InvalidInputError(
                    "prompt_name applies to text inputs only", param="prompt_name"
                )
            ids = [self._check_tokens(i, x) for i, x in enumerate(items)]
            if limit is not None:
                ids = [x[:limit] if keep == "first" else x[len(x) - limit :] for x in ids]
        else:
            raise InvalidInputError(
                "inputs must be all strings or all lists of token ids "
                "(not a mix, not nested deeper)",
                param="input",
            )
        for i, x in enumerate(ids):
            self._check_length(i, len(x), truncating=limit is not None)
        return ids

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

    def _check_tokens(self, i: int, tokens) -> np.ndarray:
        ids = np.asarray(tokens)
        if ids.size == 0:
            raise InvalidInputError(f"input {i} is an empty token list", param="input")
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise InvalidInputError(
                f"input {i} must be a flat list of integer token ids", param="input"
            )
        vocab = self.deployment.vocab_size
        bad = np.nonzero((ids < 0) | (ids >= vocab))[0]
        if len(bad):
            raise InvalidInputError(
                f"input {i} has token id {int(ids[bad[0]])} at position {int(bad[0])}, "
                f"outside the vocabulary [0, {vocab})",
                param="input",
            )
        return ids.astype(np.int64)

    def _check_length(self, i: int, n: int, *, truncating: bool) -> None:
        d = self.deployment
        if n > d.max_model_len:
            raise PromptTooLongError(
                f"input {i} has {n} tokens, more than max_model_len={d.max_model_len}; "
                "shorten it or pass truncate_prompt_tokens",
                param="input",
            )
        if d.causal and n > d.kv_cache_tokens:
            raise PromptTooLongError(
                f"input {i} has {n} tokens but the KV cache holds {d.kv_cache_tokens}",
                param="input",
            )

    # -- pooling parameters -------------------------------------------------------------------

    def params(self, pooling: str, dimensions: int | None, normalize: bool | None) -> PoolingParams:
        d = self.deployment
        if pooling not in _POOLINGS:
            raise InvalidInputError(
                f"pooling must be one of {_POOLINGS}, got {pooling!r}", param="pooling"
            )
        size = d.hidden_size if pooling == "all" else d.output_dim
        if dimensions is not None:
            if not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1:
                raise InvalidInputError("dimensions must be a positive integer", param="dimensions")
            if dimensions > size:
                raise InvalidInputError(
                    f"dimensions={dimensions} is larger than the model's embedding size {size}",
                    param="dimensions",
                )
        if normalize is None:
            normalize = d.normalize if pooling != "all" else False
        return PoolingParams(pooling=pooling, normalize=bool(normalize), dimensions=dimensions)


def _is_token_list(x) -> bool:
    if isinstance(x, np.ndarray):
        return x.ndim == 1
    return isinstance(x, (list, tuple)) and all(
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in x
    )
