"""Text -> token ids with the model's own ``tokenizer.json`` (special tokens and post-processor
included: BERT's [CLS]/[SEP], the EOS that decoder embedding models append)."""

from __future__ import annotations

import itertools
import logging
import operator
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from ..errors import ModelLoadError
from . import batch_threads
from .shared_batches import SharedBatches

_IDS = operator.attrgetter("ids")  # an encoding's token ids

log = logging.getLogger("pipepool.intake")

# Up to this many texts (or pairs) are tokenised one by one on the calling thread. The Rust
# tokenizer's batch call runs on one thread pool for the whole process, whose workers take an
# outside call only once they have finished the parts of those before it: a one-text request
# would wait there behind every large request of every model in the process
# (docs/benchmarks/several-models.md, issue 35: the flood's tail).
ON_THIS_THREAD = 8
# Characters of a batch from which it goes to the tokenizer's helper, where it has one
# (``use_helper``): about 4k tokens, whose ids take a fraction of a millisecond to gather
# here, about what sending them to another process costs.
OFFLOAD_CHARS = 1 << 14
# Characters from which texts go through the batch call even when few: the one-text call
# holds the interpreter's lock throughout (~0.3 us a character here: a 28,000-word text held
# every thread of a server for ~60 ms), the batch call releases it.
UNLOCKED_CHARS = 1 << 11


class BatchHelper(Protocol):
    """Runs ``Tokenizer`` methods on large batches elsewhere (``tokenizer_process``)."""

    def run(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``Tokenizer.<method>(*args, **kwargs)``'s result; ``HelperLost`` if it has none."""
        ...

    def close(self) -> None: ...


class HelperLost(Exception):
    """A helper could not answer a call (its process exited, hung, or was closed)."""


class Tokenizer:
    """Batch tokenization; never truncates or pads (the scheduler decides what a prompt may be)."""

    def __init__(self, tokenizer_file: Path) -> None:
        self.file = tokenizer_file
        self._helper: BatchHelper | None = None
        try:
            self._tok = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:
            raise ModelLoadError(f"cannot load {tokenizer_file}: {exc}") from None
        # tokenizer.json files often carry the training-time truncation/padding (all-MiniLM's
        # says "truncate to 128, pad to 128"): applying them would silently change prompts.
        self._tok.no_truncation()
        self._tok.no_padding()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._shared = SharedBatches(self._encode)

    def use_helper(self, helper: BatchHelper) -> None:
        """From now on, batches of ``OFFLOAD_CHARS`` characters or more go to ``helper`` (a
        ``tokenizer_process.TokenizerProcess``: a server of several models keeps one model's
        large batches from holding up the others' requests in its one process; or a
        ``tokenizer_pool.TokenizerPool``: an engine's texts tokenised on the host's spare
        cores, out of its interpreter lock); a batch it cannot answer is tokenised here.
        ``close`` closes it."""
        self.close()
        self._helper = helper

    def close(self) -> None:
        """Close the helper, if one is in use."""
        helper, self._helper = self._helper, None
        if helper is not None:
            helper.close()

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` underneath (offsets, decoder, vocabulary)."""
        return self._tok

    def encode_batch(
        self, texts: list[str], *, max_tokens: int | None = None, keep: str = "first"
    ) -> list[np.ndarray]:
        """Token ids (int64) per text, with the model's special tokens.

        With ``max_tokens``, a longer text loses content tokens from its end (``keep="first"``)
        or its start (``keep="last"``); the special tokens the post-processor added stay, so a
        truncated BERT input still starts with [CLS] and ends with [SEP].
        """
        encodings = self._encode(texts)
        out = []
        for enc in encodings:
            ids = np.asarray(enc.ids, dtype=np.int64)
            if max_tokens is not None and len(ids) > max_tokens:
                ids = _truncate_keeping_specials(
                    ids, np.asarray(enc.special_tokens_mask), max_tokens, keep
                )
            out.append(ids)
        return out

    def encode_flat(
        self, texts: list[str], *, max_tokens: int | None = None, keep: str = "first"
    ) -> tuple[np.ndarray, np.ndarray]:
        """``encode_batch`` back to back: (token ids [total] int64, lengths [n] int64), with no
        array per text (the Rust tokenizer works on all texts at once, without the GIL). A
        call of fewer than ``OFFLOAD_CHARS`` characters is tokenised with the small calls of
        other threads that arrive meanwhile (``SharedBatches``)."""
        if self._offloads(texts):
            done = self._in_helper("encode_flat", texts, max_tokens=max_tokens, keep=keep)
            if done is not None:
                return done
        small = _chars(texts) < OFFLOAD_CHARS
        encodings = self._shared.encodings(texts) if small else self._encode(texts)
        # map, not generators: no Python call per text
        lengths = np.fromiter(map(len, encodings), dtype=np.int64, count=len(texts))
        if max_tokens is not None and len(lengths) and lengths.max() > max_tokens:
            ids = [
                _truncate_keeping_specials(
                    np.asarray(e.ids, dtype=np.int64), np.asarray(e.special_tokens_mask),
                    max_tokens, keep,
                ) if len(e) > max_tokens else np.asarray(e.ids, dtype=np.int64)
                for e in encodings
            ]  # fmt: skip
            lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
            return np.concatenate(ids), lengths
        flat = np.fromiter(
            itertools.chain.from_iterable(map(_IDS, encodings)),
            dtype=np.int64,
            count=int(lengths.sum()),
        )
        return flat, lengths

    def encode_pairs(
        self,
        firsts: list[str],
        seconds: list[str],
        *,
        max_tokens: int | None = None,
        keep: str = "first",
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Text pairs through the tokenizer's own pair template ([CLS] a [SEP] b [SEP] for
        BERT, <s> a </s></s> b </s> for XLM-R): (token ids, token type ids, lengths), back to
        back. A pair over ``max_tokens`` is truncated as Hugging Face tokenizers truncate pairs
        (longest_first, what sentence-transformers' CrossEncoder and TEI use): the longer text
        loses tokens from its end (``keep="first"``, the tokenizer's truncation_side "right")
        or its start (``keep="last"``: "left") until both fit; the special tokens stay."""
        if self._offloads(firsts, seconds):
            done = self._in_helper(
                "encode_pairs", firsts, seconds, max_tokens=max_tokens, keep=keep
            )
            if done is not None:
                return done
        pairs = list(zip(firsts, seconds, strict=True))
        encodings = self._encode(pairs)
        if max_tokens is not None:
            for i, enc in enumerate(encodings):
                if len(enc) > max_tokens:
                    encodings[i] = self._truncated_pair(firsts[i], seconds[i], max_tokens, keep)
        lengths = np.fromiter((len(e) for e in encodings), dtype=np.int64, count=len(encodings))
        total = int(lengths.sum())
        chain = itertools.chain.from_iterable
        ids = np.fromiter(chain(e.ids for e in encodings), dtype=np.int64, count=total)
        types = np.fromiter(chain(e.type_ids for e in encodings), dtype=np.int64, count=total)
        return ids, types, lengths

    def _offloads(self, *texts: list[str]) -> bool:
        """Whether these texts go to the helper: there is one, and they are many characters."""
        return self._helper is not None and _chars(*texts) >= OFFLOAD_CHARS

    def _in_helper(self, method: str, *args, **kwargs):
        """The helper's answer; None when it could not give one (it exited or hung: the caller
        tokenises the batch itself, and the next batch starts a new helper process)."""
        helper = self._helper
        if helper is None:
            return None
        try:
            return helper.run(method, *args, **kwargs)
        except HelperLost as exc:
            log.warning("%s; tokenising this batch in the server's process", exc)
            return None

    def _truncated_pair(self, first: str, second: str, max_tokens: int, keep: str):
        a, b = self._encode([first, second], add_special_tokens=False)
        n1, n2 = longest_first(len(a), len(b), max(max_tokens - self.pair_specials, 0))
        direction = "right" if keep == "first" else "left"
        a.truncate(n1, direction=direction)
        b.truncate(n2, direction=direction)
        return self._tok.post_process(a, b, add_special_tokens=True)

    @property
    def pair_specials(self) -> int:
        """Special tokens the pair template adds (3 for BERT, 4 for XLM-R)."""
        processor = self._tok.post_processor
        return processor.num_special_tokens_to_add(True) if processor is not None else 0

    def pair_chunks(
        self, query: str, document: str, room: int, max_chunks: int
    ) -> list[tuple[list[int], list[int]]]:
        """(token ids, token types) of the pair template around ``query`` and each of the
        document's first ``max_chunks`` consecutive windows of ``room`` tokens (Cohere's
        chunking of long documents: the whole query with every chunk)."""
        a, b = self._encode([query, document], add_special_tokens=False)
        b.truncate(room)  # the rest lands in b.overflowing, ``room`` tokens a window
        windows = [b, *b.overflowing][:max_chunks]
        pairs = [self._tok.post_process(a, w, add_special_tokens=True) for w in windows]
        return [(p.ids, p.type_ids) for p in pairs]

    def encoding(self, text: str, *, add_special_tokens: bool = True):
        """The tokenizer's encoding of one text, character offsets included; a long text's
        without holding the interpreter's lock (``UNLOCKED_CHARS``)."""
        return encode_unlocked(self._tok, text, add_special_tokens=add_special_tokens)

    def count_plain(self, text: str) -> int:
        """Tokens of a text without the post-processor's special tokens."""
        return len(encode_unlocked(self._tok, text, add_special_tokens=False, offsets=False))

    def _encode(
        self, items: list, *, add_special_tokens: bool = True, offsets: bool = False
    ) -> list:
        """``encode_items`` of this tokenizer."""
        special = add_special_tokens
        return encode_items(self._tok, items, add_special_tokens=special, offsets=offsets)

    def encode_plain(self, text: str) -> np.ndarray:
        """Token ids of a text without the post-processor's special tokens (prompt parts)."""
        encoding = encode_unlocked(self._tok, text, add_special_tokens=False, offsets=False)
        return np.asarray(encoding.ids, dtype=np.int64)

    def cut_texts(self, texts: list[str], max_tokens: int) -> list[str]:
        """Each text cut after its first ``max_tokens`` tokens (special tokens not counted), at
        the character where that token ends: Cohere's ``max_tokens_per_doc``."""
        encodings = self._encode(texts, add_special_tokens=False, offsets=True)
        return [
            text if len(enc) <= max_tokens else text[: enc.offsets[max_tokens - 1][1]]
            for text, enc in zip(texts, encodings, strict=True)
        ]

    def describe(self, texts: list[str], *, add_special_tokens: bool = True) -> list[list[dict]]:
        """Per text, its tokens as TEI's /tokenize lists them: id, text, whether special, and
        the character span in the text (None for special tokens); the post-processor's
        special tokens left out unless ``add_special_tokens``."""
        out = []
        encodings = self._encode(texts, add_special_tokens=add_special_tokens, offsets=True)
        for text, enc in zip(texts, encodings, strict=True):
            tokens = []
            for tid, special, (start, stop) in zip(
                enc.ids, enc.special_tokens_mask, enc.offsets, strict=True
            ):
                tokens.append(
                    {
                        "id": tid,
                        "text": self._tok.id_to_token(tid) if special else text[start:stop],
                        "special": bool(special),
                        "start": None if special else start,
                        "stop": None if special else stop,
                    }
                )
            out.append(tokens)
        return out

    def decode(self, ids: np.ndarray) -> str:
        """Text of token ids, special tokens dropped (benchmarks make text inputs with it)."""
        return self._tok.decode(np.asarray(ids).tolist(), skip_special_tokens=True)


def encode_items(backend: HFTokenizer, items: list, *, add_special_tokens: bool = True,
                 offsets: bool = False) -> list:  # fmt: skip
    """``backend``'s encodings of texts or (first, second) pairs: a few short ones on this
    thread, more or longer ones through the Rust tokenizer's batch call (``ON_THIS_THREAD``,
    ``UNLOCKED_CHARS``), which releases the interpreter's lock and whose encodings carry
    character offsets only where ``offsets`` asks for them (the same ids, in about four fifths
    of the time: the offsets are recomputed in characters text by text)."""
    if len(items) > ON_THIS_THREAD or _item_chars(items) >= UNLOCKED_CHARS:
        encode = backend.encode_batch if offsets else backend.encode_batch_fast
        return batch_threads.run(encode, items, add_special_tokens=add_special_tokens)
    return [
        backend.encode(item[0], item[1], add_special_tokens=add_special_tokens)
        if isinstance(item, tuple)
        else backend.encode(item, add_special_tokens=add_special_tokens)
        for item in items
    ]


def encode_unlocked(backend: HFTokenizer, text: str, *, add_special_tokens: bool = True,
                    offsets: bool = True):  # fmt: skip
    """``backend``'s encoding of one text (``encode_items``): a long one without holding the
    interpreter's lock. Character offsets only where ``offsets`` asks for them."""
    items = encode_items(backend, [text], add_special_tokens=add_special_tokens, offsets=offsets)
    return items[0]


def _chars(*texts: list[str]) -> int:
    return sum(map(len, itertools.chain(*texts)))


def _item_chars(items: list) -> int:
    """Characters of texts and (first, second) pairs."""
    return sum(batch_threads.item_sizes(items))


def _truncate_keeping_specials(
    ids: np.ndarray, special: np.ndarray, limit: int, keep: str
) -> np.ndarray:
    lead = int(np.argmin(special)) if not special.all() else len(ids)
    trail = int(np.argmin(special[::-1])) if not special.all() else 0
    content = ids[lead : len(ids) - trail]
    room = limit - lead - trail
    if room < 0:  # a limit smaller than the special tokens: plain cut
        return ids[:limit] if keep == "first" else ids[len(ids) - limit :]
    content = content[:room] if keep == "first" else content[len(content) - room :]
    return np.concatenate([ids[:lead], content, ids[len(ids) - trail :]])


def longest_first(n1: int, n2: int, room: int) -> tuple[int, int]:
    """Lengths two texts of ``n1`` and ``n2`` tokens keep within ``room`` tokens, by the
    longest_first rule of Hugging Face tokenizers (its Rust ``truncate_encodings``): only the
    longer one is cut while the shorter fits in its half; otherwise both are cut to half the
    room (the longer one gets the odd token)."""
    if n1 + n2 <= room:
        return n1, n2
    swap = n1 > n2
    if swap:
        n1, n2 = n2, n1
    n2 = n1 if n1 > room else max(n1, room - n1)
    if n1 + n2 > room:
        n1 = room // 2
        n2 = n1 + room % 2
    return (n2, n1) if swap else (n1, n2)
