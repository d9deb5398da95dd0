"""Issue 2 acceptance: pipepool tokenizes exactly as transformers.AutoTokenizer does
(special tokens included), so both sides of every parity test see the same prompt."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import REPRODUCER_PROMPTS, SENTENCES, long_prompts

from pipepool.intake.tokenizer import Tokenizer

# Beyond the test sentences: whitespace, accents, typography, emoji, case, control characters,
# special-token text typed by a user.
EXTRA = [
    "  leading and trailing spaces  ",
    "naïve café — “quoted” déjà vu",
    "emoji 🙂 and CJK 漢字",
    "UPPER lower MiXeD 12345 3.14159",
    "tabs\tand\nnewlines",
    "[CLS] <s> </s> <|endoftext|> typed by hand",
    " ",
    "x",
]
PROMPTS = [*SENTENCES, *long_prompts(), *REPRODUCER_PROMPTS, *EXTRA]


def _assert_same_ids(path) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(path))
    ours = Tokenizer(path / "tokenizer.json").encode_batch(PROMPTS)
    for text, ids in zip(PROMPTS, ours, strict=True):
        expected = reference(text, add_special_tokens=True)["input_ids"]
        assert ids.dtype == np.int64
        assert ids.tolist() == expected, f"{text[:40]!r}"


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama", "mistral"])
def test_decoder_tokenizer_matches_transformers(decoder_paths, family):
    _assert_same_ids(decoder_paths[family])


def test_minilm_tokenizer_matches_transformers(minilm_path):
    # all-MiniLM's tokenizer.json asks for truncation/padding to 128; pipepool never applies
    # them (prompts over the limit are an error or truncated on request), nor does a plain
    # AutoTokenizer call.
    _assert_same_ids(minilm_path)
    lengths = [len(ids) for ids in Tokenizer(minilm_path / "tokenizer.json").encode_batch(PROMPTS)]
    assert max(lengths) > 128


def _assert_truncation_matches(path, limits) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(path))
    tok = Tokenizer(path / "tokenizer.json")
    # Special-token text typed by a user is content: it may be cut like any other token.
    typed = "[CLS] <s> </s> <|endoftext|> typed by hand, " * 4 + "[SEP] </s> <|endoftext|>"
    for text in (long_prompts()[3], typed):
        for limit in limits:
            for keep, side in (("first", "right"), ("last", "left")):
                (ids,) = tok.encode_batch([text], max_tokens=limit, keep=keep)
                reference.truncation_side = side
                expected = reference(text, truncation=True, max_length=limit)["input_ids"]
                assert ids.tolist() == expected, f"{text[:20]!r}: {limit}, side={side}"


def test_truncation_keeps_bert_special_tokens_like_transformers(minilm_path):
    _assert_truncation_matches(minilm_path, (2, 3, 10, 100))
    (ids,) = Tokenizer(minilm_path / "tokenizer.json").encode_batch(
        [long_prompts()[3]], max_tokens=10, keep="last"
    )
    assert ids[0] == 101 and ids[-1] == 102  # [CLS] ... [SEP]


def test_truncation_in_the_batch_call_matches_transformers(minilm_path):
    """More than ``ON_THIS_THREAD`` texts: the batch call without offsets, whose special-token
    masks the truncation reads."""
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(minilm_path))
    texts = [*long_prompts(), *EXTRA, *SENTENCES]
    tok = Tokenizer(minilm_path / "tokenizer.json")
    for keep, side in (("first", "right"), ("last", "left")):
        reference.truncation_side = side
        got = tok.encode_batch(texts, max_tokens=10, keep=keep)
        flat, lengths = tok.encode_flat(texts, max_tokens=10, keep=keep)
        expected = [reference(t, truncation=True, max_length=10)["input_ids"] for t in texts]
        assert [ids.tolist() for ids in got] == expected
        assert flat.tolist() == [i for row in expected for i in row]
        assert lengths.tolist() == [len(row) for row in expected]


@pytest.mark.parametrize("family", ["qwen3", "llama", "mistral"])
def test_decoder_truncation_keeps_special_tokens_like_transformers(decoder_paths, family):
    _assert_truncation_matches(decoder_paths[family], (3, 16, 32))


class _Calls:
    """The Rust tokenizer underneath, recording which of its methods each call took."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.calls: list[str] = []

    def __getattr__(self, name: str):  # what is not recorded
        return getattr(self.backend, name)

    def encode(self, *args, **kwargs):
        self.calls.append("encode")
        return self.backend.encode(*args, **kwargs)

    def encode_batch(self, *args, **kwargs):
        self.calls.append("encode_batch")
        return self.backend.encode_batch(*args, **kwargs)

    def encode_batch_fast(self, *args, **kwargs):
        self.calls.append("encode_batch_fast")
        return self.backend.encode_batch_fast(*args, **kwargs)


def test_a_few_texts_stay_on_the_calling_thread_with_the_batch_calls_ids(minilm_path):
    from pipepool.intake.tokenizer import ON_THIS_THREAD

    tokenizer = Tokenizer(minilm_path / "tokenizer.json")
    backend = tokenizer.backend
    recorder = _Calls(backend)
    tokenizer._tok = recorder
    for texts, expected_call in [
        (EXTRA[:ON_THIS_THREAD], "encode"),  # one by one: never the process-wide pool
        (PROMPTS, "encode_batch_fast"),  # ids without the offsets, which nothing here reads
    ]:
        recorder.calls.clear()
        ids = [a.tolist() for a in tokenizer.encode_batch(texts)]
        assert ids == [e.ids for e in backend.encode_batch(texts)]
        flat, lengths = tokenizer.encode_flat(texts)
        assert flat.tolist() == [i for row in ids for i in row] and lengths.sum() == len(flat)
        pairs = tokenizer.encode_pairs(texts, texts[::-1])
        expected = backend.encode_batch(list(zip(texts, texts[::-1], strict=True)))
        assert pairs[0].tolist() == [i for e in expected for i in e.ids]
        assert pairs[1].tolist() == [i for e in expected for i in e.type_ids]
        assert set(recorder.calls) == {expected_call}


def test_a_long_text_is_tokenised_without_holding_the_interpreters_lock(minilm_path):
    # The one-text call holds the GIL throughout; a long text alone goes to the batch call,
    # which releases it, and gives the one-text call's ids and offsets.
    from pipepool.intake.tokenizer import UNLOCKED_CHARS, encode_unlocked

    tokenizer = Tokenizer(minilm_path / "tokenizer.json")
    backend = tokenizer.backend
    recorder = _Calls(backend)
    tokenizer._tok = recorder
    long = " ".join(PROMPTS) * (UNLOCKED_CHARS // len(" ".join(PROMPTS)) + 1)
    assert len(long) >= UNLOCKED_CHARS
    alone, plain = backend.encode(long), backend.encode(long, add_special_tokens=False)

    assert tokenizer.encode_batch([long])[0].tolist() == alone.ids
    assert tokenizer.encode_flat([long])[0].tolist() == alone.ids
    encoding = tokenizer.encoding(long, add_special_tokens=False)
    assert encoding.ids == plain.ids and encoding.offsets == plain.offsets
    assert tokenizer.count_plain(long) == len(plain.ids)
    assert tokenizer.encode_plain(long).tolist() == plain.ids
    windows = tokenizer.pair_chunks("a query", long, room=100, max_chunks=3)
    query = backend.encode("a query", add_special_tokens=False)
    document = backend.encode(long, add_special_tokens=False)
    document.truncate(100)
    expected = [
        backend.post_process(query, w, add_special_tokens=True).ids
        for w in [document, *document.overflowing][:3]
    ]
    assert [list(w[0]) for w in windows] == expected and len(expected) == 3
    pairs = tokenizer.encode_pairs(["a query"], [long])
    assert pairs[0].tolist() == backend.encode("a query", long).ids
    unlocked = encode_unlocked(recorder, long)
    assert unlocked.ids == alone.ids and unlocked.offsets == alone.offsets
    assert encode_unlocked(recorder, long, offsets=False).ids == alone.ids
    assert "encode" not in recorder.calls and recorder.calls, recorder.calls
    assert encode_unlocked(recorder, "short").ids == backend.encode("short").ids
    assert recorder.calls[-1] == "encode"  # a short text stays on the one-text call
