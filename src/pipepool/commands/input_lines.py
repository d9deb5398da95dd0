"""What ``embed`` and its sparse / multi-vector outputs share about input lines: the ids of a
blank line embedded as sentence-transformers embeds "", and errors that name their line."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import InvalidInputError

if TYPE_CHECKING:
    from ..api.engine import Engine


def empty_text_ids(
    engine: Engine, prompt_name: str | None, truncate: int | None, texts: bool
) -> np.ndarray:
    """Token ids of "" as the engine would make them were it to take an empty text: the
    prompt (``prompt_name``, else the model's default one; only where the other inputs are
    ``texts``, as the engine prompts no token ids) and the tokenizer's special tokens, cut as
    ``truncate`` (--truncate-prompt-tokens) cuts a text."""
    info = engine.info
    prefix = info.prompt_text(prompt_name) if texts else ""
    limit = info.max_model_len if truncate == -1 else truncate
    ids = engine.tokenizer.encode_batch([prefix], max_tokens=limit if limit and limit > 0 else None)
    if not len(ids[0]):
        raise InvalidInputError(
            "an empty text has no tokens for this model (its tokenizer adds no special tokens "
            "and no prompt is set): there is nothing to embed for a blank line; leave "
            "--keep-blank off to skip blank lines",
            param="input",
        )
    return ids[0]


def located(exc: InvalidInputError, origins: list[str]) -> InvalidInputError:
    """The engine's error with the line (or argument) the bad input came from; ``origins``:
    those of the inputs of the call that raised it."""
    if exc.index is None or not 0 <= exc.index < len(origins):
        return exc
    return type(exc)(f"{origins[exc.index]}: {exc}", param=exc.param, index=exc.index)
