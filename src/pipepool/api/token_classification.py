"""Token classification (NER) results as transformers' token-classification pipeline gives them:
per token, or grouped into entities with character offsets ("simple": adjacent tokens of one
entity type; "first", "average", "max": words labelled by their first sub-token, by the mean of
their sub-tokens' probabilities, or by their most confident sub-token, then grouped).

The engine returns each token's label probabilities (``*ForTokenClassification`` heads run on
the last stage); this module only reads the tokenizer's offsets, words and sub-word marks of the
same tokens and aggregates, on the host.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from ..errors import InvalidInputError
from ..intake.tokenizer import encode_unlocked

AGGREGATIONS = ("none", "simple", "first", "average", "max")
IGNORED_LABELS = ("O",)  # the pipeline's default: tokens outside any entity are not reported


def check_strategy(strategy: str) -> None:
    if strategy not in AGGREGATIONS:
        raise InvalidInputError(
            f"aggregation_strategy must be one of {', '.join(AGGREGATIONS)}, got {strategy!r}",
            param="aggregation_strategy",
        )


class TokenAggregator:
    """Turns one text's token probabilities into the pipeline's entity dicts. Holds the
    tokenizer (``tokenizers.Tokenizer``) and the label names; no per-call state."""

    def __init__(self, tokenizer, labels: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.labels = tuple(labels)
        # A word-aware vocabulary (WordPiece's "##", some BPEs) marks continuing sub-tokens;
        # otherwise the pipeline's fallback guesses from the characters around a token.
        self.subword_prefix = getattr(tokenizer.model, "continuing_subword_prefix", None)
        self.unk_id = _unk_id(tokenizer)

    def entities(self, text: str, probs: np.ndarray, strategy: str) -> list:
        """The entities of ``text`` from its per-token label probabilities ``probs`` [len,
        labels], as the engine computed them for the tokenizer's own tokens of the text."""
        check_strategy(strategy)
        encoding = encode_unlocked(self.tokenizer, text, add_special_tokens=True)
        n = len(probs)
        ids, offsets, special = encoding.ids, encoding.offsets, encoding.special_tokens_mask
        if n < len(ids):  # truncated: the engine kept the head and the closing special token
            ids, offsets = [*ids[: n - 1], ids[-1]], [*offsets[: n - 1], offsets[-1]]
            special = [*special[: n - 1], special[-1]]
        ids = np.asarray(ids, dtype=np.int64)
        pre = self._pre_entities(text, ids, probs, offsets, special)
        if strategy in ("first", "average", "max"):
            tokens = self._words(pre, strategy)
        else:
            tokens = [self._token_entity(p) for p in pre]
        if strategy == "none":
            return [e for e in tokens if e["entity"] not in IGNORED_LABELS]
        groups = _group(tokens, self._decode)
        return [g for g in groups if g["entity_group"] not in IGNORED_LABELS]

    def _pre_entities(self, text, ids, probs, offsets, special) -> list[dict]:
        pre = []
        for idx, (token_id, scores) in enumerate(zip(ids.tolist(), probs, strict=True)):
            if special[idx]:
                continue
            word = self.tokenizer.id_to_token(token_id)
            start, end = offsets[idx]
            word_ref = text[start:end]
            if self.subword_prefix:
                is_subword = len(word) != len(word_ref)
            else:
                is_subword = start > 0 and " " not in text[start - 1 : start + 1]
            if token_id == self.unk_id:
                word, is_subword = word_ref, False
            pre.append(
                {"word": word, "scores": scores, "start": start, "end": end, "index": idx,
                 "is_subword": is_subword}
            )  # fmt: skip
        return pre

    def _token_entity(self, pre: dict) -> dict:
        best = int(pre["scores"].argmax())
        return {
            "entity": self.labels[best],
            "score": float(pre["scores"][best]),
            "index": pre["index"],
            "word": pre["word"],
            "start": pre["start"],
            "end": pre["end"],
        }

    def _words(self, pre: list[dict], strategy: str) -> list[dict]:
        """Each word (a token and the sub-tokens after it) with one label for all of it."""
        words: list[list[dict]] = []
        for p in pre:
            if words and p["is_subword"]:
                words[-1].append(p)
            else:
                words.append([p])
        out = []
        for word in words:
            if strategy == "first":
                scores = word[0]["scores"]
            elif strategy == "max":
                scores = max(word, key=lambda p: p["scores"].max())["scores"]
            else:  # average
                scores = np.nanmean(np.stack([p["scores"] for p in word]), axis=0)
            best = int(scores.argmax())
            out.append(
                {"entity": self.labels[best], "score": float(scores[best]),
                 "word": self._decode([p["word"] for p in word]),
                 "start": word[0]["start"], "end": word[-1]["end"]}
            )  # fmt: skip
        return out

    def _decode(self, tokens: list[str]) -> str:
        decoder = self.tokenizer.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)


def _tag(entity: str) -> tuple[str, str]:
    """("B" or "I", the type): labels without a B-/I- prefix count as a continuation."""
    if entity.startswith(("B-", "I-")):
        return entity[0], entity[2:]
    return "I", entity


def _group(entities: list[dict], decode) -> list[dict]:
    """Adjacent tokens (or words) of one type, a B- label starting a new group."""
    groups: list[list[dict]] = []
    for entity in entities:
        bi, tag = _tag(entity["entity"])
        if groups and bi != "B" and _tag(groups[-1][-1]["entity"])[1] == tag:
            groups[-1].append(entity)
        else:
            groups.append([entity])
    return [
        {
            "entity_group": g[0]["entity"].split("-", 1)[-1],
            "score": float(np.mean([e["score"] for e in g])),
            "word": decode([e["word"] for e in g]),
            "start": g[0]["start"],
            "end": g[-1]["end"],
        }
        for g in groups
    ]


def _unk_id(tokenizer) -> int | None:
    """The unknown token's id: WordPiece and BPE name the token, Unigram stores its id."""
    unk = getattr(tokenizer.model, "unk_token", None)
    if unk:
        return tokenizer.token_to_id(unk)
    unk_id = json.loads(tokenizer.to_str())["model"].get("unk_id")
    return int(unk_id) if unk_id is not None else None
