"""Late chunking (Günther et al., arXiv 2409.04701): a document runs through the model once and
each of its chunks is pooled from the document's token states, so a chunk's vector sees its
context. Built on the engine's public token embeddings (``Engine.embed_tokens``), so it is exact
under every pipeline the engine runs (PP, chunked prefill, replicas).

The rule, for a document ``text`` and chunk spans ``[start, end)`` in characters:

- The text is tokenised once without special tokens, with each token's character offsets. A
  token belongs to the chunk whose span holds the offset where the token starts; tokens of no
  chunk (text between spans) and special tokens belong to none. Given chunks rather than spans
  (Jina's ``late_chunking``), the chunks are joined with one space and chunk ``c``'s span runs
  from the space before it (so a byte-level BPE token that starts with that space, " word", is
  the chunk's) to its end; a model prompt (``prompt_name``) goes before the document and is
  nobody's chunk.
- Each chunk's vector is the mean of its tokens' final hidden states, then the Matryoshka cut
  (``dimensions``) and the model's normalisation (or ``normalize``).
- Documents longer than the model's context are split into macro-chunks (the paper's long late
  chunking): windows of ``W = max_model_len - specials`` content tokens, each wrapped in the
  model's special tokens, window ``k`` starting at token ``k * (W - overlap)`` with
  ``overlap = min(256, W // 4)``; a token's state is taken from the earliest window that holds
  it, so every window after the first sees ``overlap`` tokens of left context whose states it
  does not contribute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from ..errors import InvalidInputError

if TYPE_CHECKING:
    from .engine import Engine

# Left context of every macro-chunk after the first, at most (tokens).
MAX_OVERLAP = 256


@dataclass(frozen=True)
class LateChunkedText:
    """One document as late chunking reads it: the text the tokenizer sees (a prompt, then the
    document) and each chunk's character span ``[start, end)`` in that text."""

    text: str
    spans: tuple[tuple[int, int], ...]
    prompt_chars: int = 0  # the prompt's length: ``text`` from there on is the document

    @classmethod
    def from_chunks(cls, chunks: list[str], prompt: str = "") -> LateChunkedText:
        """Consecutive chunks of one document, joined with one space (Jina's rule)."""
        spans, at = [], len(prompt)
        for i, chunk in enumerate(chunks):
            start = at - 1 if i else at  # the joining space is the chunk's
            at += len(chunk)
            spans.append((start, at))
            at += 1
        return cls(prompt + " ".join(chunks), tuple(spans), len(prompt))

    @classmethod
    def from_spans(
        cls, text: str, spans: list[tuple[int, int]], prompt: str = ""
    ) -> LateChunkedText:
        """A document and its chunks' character spans ``[start, end)``, in order and not
        overlapping; raises InvalidInputError naming a span that is not."""
        at = 0
        for c, (lo, hi) in enumerate(spans):
            if not at <= lo < hi <= len(text):
                raise InvalidInputError(
                    f"span {c} [{lo}, {hi}) is not within the text ({len(text)} characters) "
                    "after the span before it, or is empty",
                    param="spans",
                )
            at = hi
        if not spans:
            raise InvalidInputError("a document needs at least one span", param="spans")
        shift = len(prompt)
        return cls(prompt + text, tuple((lo + shift, hi + shift) for lo, hi in spans), shift)


@dataclass(frozen=True)
class LateChunks:
    """One document's chunk vectors, and the tokens each chunk cost: its own tokens, the
    first chunk also every token the model ran besides (special tokens, a prompt, tokens
    between chunks, macro-chunk overlaps), so that they add up to what was computed."""

    vectors: np.ndarray  # [num_chunks, dim] float32
    num_tokens: list[int]  # per chunk


def late_chunk_texts(
    engine: Engine,
    chunks,
    *,
    dimensions: int | None = None,
    normalize: bool | None = None,
    truncate_prompt_tokens: int | None = None,
    truncation_side: str = "right",
    prompt_name: str | None = None,
    long_inputs: str | None = None,
) -> LateChunks:
    """``Engine.embed(chunks, late_chunking=True)``: ``chunks`` (strings, as ``embed`` takes
    inputs) are consecutive chunks of one document, joined with one space after the model's
    prompt. Truncation options are refused by name: the whole document is embedded."""
    if truncate_prompt_tokens is not None or long_inputs not in (None, "chunk"):
        raise InvalidInputError(
            "late_chunking embeds the whole document (over-long ones in overlapping windows): "
            "truncate_prompt_tokens and long_inputs do not apply",
            param="late_chunking",
        )
    if truncation_side != "right":
        raise InvalidInputError(
            "late_chunking does not truncate: truncation_side does not apply",
            param="truncation_side",
        )
    items = (
        [chunks] if isinstance(chunks, str)
        else list(chunks) if isinstance(chunks, (list, tuple, np.ndarray)) else []
    )  # fmt: skip
    if not items or not all(isinstance(c, str) for c in items):
        raise InvalidInputError(
            "late_chunking takes the chunks of one document as a list of strings", param="input"
        )
    prompt = engine.info.prompt_text(prompt_name)
    document = LateChunkedText.from_chunks(items, prompt)
    return late_chunk(engine, document, dimensions=dimensions, normalize=normalize)


def late_chunk(
    engine: Engine,
    document: LateChunkedText,
    *,
    dimensions: int | None = None,
    normalize: bool | None = None,
) -> LateChunks:
    """One vector per span of ``document``, by the module's rule. Raises InvalidInputError
    naming a chunk without tokens, or what the model cannot late-chunk (a classifier, a
    sparse or multi-vector head, Dense modules after pooling)."""
    _check_model(engine)
    encoding = engine.tokenizer.encoding(document.text, add_special_tokens=False)
    ids = np.asarray(encoding.ids, dtype=np.int64)  # [n]
    starts = np.fromiter((o[0] for o in encoding.offsets), dtype=np.int64, count=len(ids))
    owner = _owners(starts, document.spans)  # [n]: chunk index of each token, -1: none
    for c in range(len(document.spans)):
        if not (owner == c).any():
            raise InvalidInputError(
                f"chunk {c} has no tokens (an empty or blank chunk cannot be embedded)",
                param="input",
            )
    states, ran = _token_states(engine, ids)  # [n, hidden], tokens computed
    sums = np.zeros((len(document.spans), states.shape[1]), dtype=np.float64)
    kept = owner >= 0
    np.add.at(sums, owner[kept], states[kept])
    counts = np.bincount(owner[kept], minlength=len(document.spans))
    vectors = (sums / counts[:, None]).astype(np.float32)  # [chunks, hidden]
    num_tokens = counts.tolist()
    num_tokens[0] += ran - sum(num_tokens)
    return LateChunks(_finish(engine, vectors, dimensions, normalize), num_tokens)


def macro_windows(n: int, width: int) -> list[tuple[int, int, int]]:
    """``(start, end, first_kept)`` of each macro-chunk over ``n`` content tokens, ``width``
    tokens each at most: window k covers ``[start, end)`` and contributes ``[first_kept,
    end)``, the tokens no earlier window holds."""
    if n <= width:
        return [(0, n, 0)]
    overlap = min(MAX_OVERLAP, width // 4)
    stride = width - overlap
    windows, start, covered = [], 0, 0
    while covered < n:
        end = min(start + width, n)
        windows.append((start, end, covered))
        covered = end
        start += stride
    return windows


def _owners(starts: np.ndarray, spans: tuple[tuple[int, int], ...]) -> np.ndarray:
    owner = np.full(len(starts), -1, dtype=np.int64)
    for c, (lo, hi) in enumerate(spans):
        owner[(starts >= lo) & (starts < hi)] = c
    return owner


def _token_states(engine: Engine, ids: np.ndarray) -> tuple[np.ndarray, int]:
    """Final hidden states ``[n, hidden]`` of the content tokens ``ids``, each from the
    earliest macro-chunk that holds it, the model's special tokens around every window; and
    the number of tokens the model ran."""
    prefix, suffix = _special_tokens(engine)
    width = engine.info.max_model_len - len(prefix) - len(suffix)
    if width < 2:
        raise InvalidInputError(
            f"max_model_len={engine.info.max_model_len} leaves no room for a document "
            "between the model's special tokens",
            param="input",
        )
    windows = macro_windows(len(ids), width)
    prompts = [np.concatenate([prefix, ids[lo:hi], suffix]) for lo, hi, _ in windows]
    # token ids as arrays (the engine packs them without a Python loop over tokens)
    outputs = engine.embed_tokens(cast(list, prompts), normalize=False, long_inputs="error")
    parts = []
    for (lo, hi, first_kept), out in zip(windows, outputs, strict=True):
        rows = out[len(prefix) : len(prefix) + (hi - lo)]  # [hi - lo, hidden]
        parts.append(rows[first_kept - lo :])
    return np.concatenate(parts), sum(len(p) for p in prompts)


def _special_tokens(engine: Engine) -> tuple[np.ndarray, np.ndarray]:
    """The ids the model's tokenizer puts before and after one text's tokens."""
    tok = engine.tokenizer.backend
    encoding = tok.encode("a", add_special_tokens=True)
    mask = np.asarray(encoding.special_tokens_mask, dtype=bool)
    ids = np.asarray(encoding.ids, dtype=np.int64)
    content = np.flatnonzero(~mask)
    first, last = int(content[0]), int(content[-1])
    return ids[:first], ids[last + 1 :]


def _check_model(engine: Engine) -> None:
    info = engine.info
    why = None
    if info.classifier is not None:
        why = "a classifier or reranker gives scores, not embeddings"
    elif info.outputs != ("dense",):
        why = "its sparse or multi-vector head pools in its own way"
    elif info.dense_modules:
        why = "it has Dense modules after pooling, which apply to whole-text vectors"
    if why is not None:
        raise InvalidInputError(
            f"late_chunking is not supported for this model: {why}", param="late_chunking"
        )


def _finish(
    engine: Engine, vectors: np.ndarray, dimensions: int | None, normalize: bool | None
) -> np.ndarray:
    """The Matryoshka cut, then the model's normalisation (or ``normalize``)."""
    params = engine.info.pooling_params("mean", dimensions, normalize)
    if params.dimensions is not None:
        vectors = vectors[:, : params.dimensions]
    if params.normalize:
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        vectors = vectors / np.maximum(norms, 1e-12)
    return np.ascontiguousarray(vectors, dtype=np.float32)
