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


@pytest.mark.parametrize("family", ["qwen3", "llama", "mistral"])
def test_decoder_truncation_keeps_special_tokens_like_transformers(decoder_paths, family):
    _assert_truncation_matches(decoder_paths[family], (3, 16, 32))
