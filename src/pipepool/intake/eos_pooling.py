"""CLIP's text tower pools the token transformers picks, which pipepool reads as the last one
(``models/towers.py``): the first EOS (``eos_token_id``), or the highest token id where a
config still says ``eos_token_id: 2`` (checkpoints saved before transformers' PR #24773). Its
tokenizer puts the EOS last, truncation included; an input where that token is elsewhere (a
token-id list, or a text spelling the EOS out) is refused rather than pooled at another row."""

from __future__ import annotations

import numpy as np

from ..errors import InvalidInputError


def eos_token_of(hf: dict, architecture: str) -> int | None:
    """The EOS id whose row CLIP pools (-1: the highest id, the legacy rule), or None where
    the model pools otherwise."""
    if architecture != "CLIPModel":
        return None
    eos = int((hf.get("text_config") or {}).get("eos_token_id", 2))
    return -1 if eos == 2 else eos


def check_eos_last(eos: int | None, first: int, flat: np.ndarray, lengths: np.ndarray) -> None:
    """Raise InvalidInputError naming the first input whose pooled token is not its last."""
    if eos is None or not len(lengths):
        return
    ends = np.cumsum(lengths)
    starts = ends - lengths
    if eos == -1:  # the highest id of each input, its first occurrence pooled
        target: np.ndarray | int = np.repeat(np.maximum.reduceat(flat, starts), lengths)
        what = "its highest token id (transformers' pooled token for eos_token_id 2)"
    else:
        target = eos
        what = f"its EOS token (id {eos})"
    hits = flat == target
    count = np.add.reduceat(hits.astype(np.int64), starts)
    bad_rows = np.flatnonzero(~hits[ends - 1] | (count != 1)).tolist()
    if bad_rows:
        i = min(bad_rows)
        raise InvalidInputError(
            f"input {first + i}: CLIP pools {what}, which must be the input's last token and "
            "appear once (as its tokenizer makes it); this one does not end so",
            param="input",
            index=first + i,
        )
