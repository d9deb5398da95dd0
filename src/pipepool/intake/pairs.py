"""Query-document pairs as one prompt each, the way the classifier was trained to read them
(``ClassifierHead.template``):

- "pair": the tokenizer's own pair template ([CLS] q [SEP] d [SEP] with token types 0 then 1
  for BERT; <s> q </s></s> d </s> for XLM-R), truncated longest-first as Hugging Face
  tokenizers (and so sentence-transformers' CrossEncoder) truncate pairs.
- "qwen3": Qwen3-Reranker's published prompt, tokenized as its model card does: a fixed system
  prefix and assistant suffix around ``<Instruct>: {instruction}\\n<Query>: {query}\\n
  <Document>: {document}``; prefix and suffix tokenized apart, the middle cut to fit.

Token types ride with the token ids (``TokenSlice.type_ids``) only where the model reads them:
encoders of a family that reads them (BERT, ELECTRA) with more than one token type. RoBERTa /
XLM-R tokenizers give the model no token types (transformers feeds zeros), and decoders have
none.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import InvalidInputError
from ..loading.deployment import Deployment
from ..models import family_of
from .inputs import InputPreparer, TokenSlice

# Qwen3-Reranker's prompt (its model card, 2025-06): the model answers "yes" or "no" after it.
QWEN3_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"

# The same prompt as a chat template with "query" and "document" roles, which is how
# sentence-transformers' CrossEncoder (6.x) reads a causal reranker: put it in the model folder
# as chat_template.jinja and CrossEncoder(folder).predict gives the model card's scores (the
# benchmark's peer and a test use it). The final newlines are written out: Jinja drops a
# template's last newline.
QWEN3_CHAT_TEMPLATE = (
    QWEN3_PREFIX + "<Instruct>: " + QWEN3_INSTRUCTION + "\n<Query>: "
    '{{ messages | selectattr("role", "eq", "query") | map(attribute="content") | first }}'
    "\n<Document>: "
    '{{ messages | selectattr("role", "eq", "document") | map(attribute="content") | first }}'
    + QWEN3_SUFFIX.removesuffix("\n\n")
    + '{{ "\\n\\n" }}'
)


def qwen3_body(instruction: str, query: str, document: str) -> str:
    """The middle of Qwen3-Reranker's prompt (its ``format_instruction``)."""
    return f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"


class PairEncoder:
    """Token ids (and token types) of query-document pairs for the deployment's classifier."""

    def __init__(self, deployment: Deployment, inputs: InputPreparer) -> None:
        head = deployment.classifier
        assert head is not None, "pairs are encoded for classifier models only"
        self.deployment, self.inputs, self.template = deployment, inputs, head.template
        self.tokenizer = inputs.tokenizer
        hf = deployment.folder.hf_config
        family = family_of(deployment.folder.architecture)
        self.use_types = family.reads_token_types and int(hf.get("type_vocab_size", 2)) > 1
        if self.template == "qwen3":
            self.prefix = self.tokenizer.encode_plain(QWEN3_PREFIX)
            self.suffix = self.tokenizer.encode_plain(QWEN3_SUFFIX)

    def encode(
        self,
        queries: Sequence[str],
        documents: Sequence[str],
        *,
        limit: int | None,
        instruction: str | None = None,
        max_tokens_per_doc: int | None = None,
        max_tokens_per_query: int | None = None,
        keep: str = "first",
    ) -> TokenSlice:
        """Pair i is (queries[i], documents[i]). ``limit``: longest prompt kept (longer pairs
        are truncated, losing tokens from their texts' ends, ``keep="first"``, or starts,
        ``keep="last"``); None: none is truncated, and one over max_model_len is refused.
        ``max_tokens_per_doc`` / ``max_tokens_per_query`` cut each document / query to its
        first N tokens before that (Cohere's and vLLM's options)."""
        # Refused by the caller elsewhere (retrieval_scoring.refuse_other_pair_options).
        assert instruction is None or self.template == "qwen3", "an instruction is Qwen3's"
        # Valid Unicode, and no text far longer than any prompt could hold, before tokenising.
        longest = self.deployment.max_model_len
        check = self.inputs.checked_texts  # (an empty text is half of a valid pair)
        queries = check(list(queries), limit, longest, param="query", allow_empty=True)
        documents = check(list(documents), limit, longest, param="documents", allow_empty=True)
        documents = self._cut(documents, max_tokens_per_doc, "max_tokens_per_doc")
        queries = self._cut(queries, max_tokens_per_query, "max_tokens_per_query")
        if keep not in ("first", "last"):
            raise InvalidInputError(
                "truncation_side must be 'right' or 'left'", param="truncation_side"
            )
        if self.template == "qwen3":
            ids, lengths = self._qwen3(queries, documents, limit, instruction, keep)
            types = None
        else:
            ids, types, lengths = self.tokenizer.encode_pairs(
                list(queries), list(documents), max_tokens=limit, keep=keep
            )
            if not self.use_types or not types.any():
                types = None
        empty = np.nonzero(lengths == 0)[0]
        if len(empty):
            i = int(empty[0])
            raise InvalidInputError(f"pair {i} has no tokens", param="documents", index=i)
        self.inputs._check_lengths(
            0, lengths, self.deployment.max_model_len, name="pair", param="documents"
        )
        return TokenSlice(0, ids, lengths, types)

    def chunk_room(self, query: str, window: int) -> int:
        """Tokens of a document that fit beside ``query`` in a prompt of ``window`` tokens
        (one chunk of Cohere's chunking); a 400 when there are none."""
        if self.template != "pair":
            raise InvalidInputError(
                "max_chunks_per_doc splits a document beside the query in the tokenizer's pair "
                f"template; this model ({self.deployment.folder.architecture}) builds its own "
                "prompt around query and document: cut long documents yourself",
                param="max_chunks_per_doc",
            )
        used = self.tokenizer.count_plain(query) + self.tokenizer.pair_specials
        if used >= window:
            raise InvalidInputError(
                f"the query and the prompt's special tokens take {used} tokens of the {window} "
                "a prompt may hold: no room is left for a document chunk",
                param="query",
            )
        return window - used

    def _cut(self, texts: list[str], max_tokens: int | None, param: str) -> list[str]:
        if max_tokens is None:
            return texts
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidInputError(f"{param} must be a positive integer", param=param)
        return self.tokenizer.cut_texts(list(texts), max_tokens)

    def length(self, query: str, document: str) -> int:
        """Tokens of the pair's prompt, untruncated (built-in parity documents are sized by
        it)."""
        if self.template == "qwen3":
            body = qwen3_body(QWEN3_INSTRUCTION, query, document)
            _, lengths = self.tokenizer.encode_flat([body])
            return int(lengths[0]) + len(self.prefix) + len(self.suffix)
        return int(self.tokenizer.encode_pairs([query], [document])[2][0])

    def _qwen3(
        self,
        queries: Sequence[str],
        documents: Sequence[str],
        limit: int | None,
        instruction: str | None,
        keep: str,
    ) -> tuple[np.ndarray, np.ndarray]:
        instruction = QWEN3_INSTRUCTION if instruction is None else instruction
        bodies = [qwen3_body(instruction, q, d) for q, d in zip(queries, documents, strict=True)]
        fixed = len(self.prefix) + len(self.suffix)
        room = None if limit is None else limit - fixed
        if room is not None and room < 1:
            raise InvalidInputError(
                f"the Qwen3-Reranker prompt takes {fixed} tokens by itself; a limit of {limit} "
                "tokens leaves no room for query and document",
                param="truncate_prompt_tokens",
            )
        body_ids, body_lengths = self.tokenizer.encode_flat(bodies, max_tokens=room, keep=keep)
        parts = []
        for body in np.split(body_ids, np.cumsum(body_lengths)[:-1]):
            parts += [self.prefix, body, self.suffix]
        return np.concatenate(parts), body_lengths + fixed


def encode_chunks(
    encoder: PairEncoder,
    queries: Sequence[str],
    documents: Sequence[str],
    *,
    window: int,
    max_chunks: int,
    max_tokens_per_doc: int | None = None,
    max_tokens_per_query: int | None = None,
) -> tuple[TokenSlice, np.ndarray]:
    """Cohere's chunking of long documents: each document (cut to ``max_tokens_per_doc``
    first) split into consecutive windows that fit beside its whole query in a prompt of
    ``window`` tokens, its first ``max_chunks`` windows kept. Returns the prompts, one per
    chunk, and for each the index of the pair it came from (ascending)."""
    if isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks < 1:
        raise InvalidInputError(
            "max_chunks_per_doc must be a positive integer", param="max_chunks_per_doc"
        )
    check = encoder.inputs.checked_texts  # no length bound: long documents are chunked
    queries = check(list(queries), None, None, param="query", allow_empty=True)
    documents = check(list(documents), None, None, param="documents", allow_empty=True)
    documents = encoder._cut(documents, max_tokens_per_doc, "max_tokens_per_doc")
    queries = encoder._cut(queries, max_tokens_per_query, "max_tokens_per_query")
    rooms: dict[str, int] = {}
    ids: list[int] = []
    types: list[int] = []
    lengths: list[int] = []
    owners: list[int] = []
    for i, (query, document) in enumerate(zip(queries, documents, strict=True)):
        if query not in rooms:
            rooms[query] = encoder.chunk_room(query, window)
        for chunk_ids, chunk_types in encoder.tokenizer.pair_chunks(
            query, document, rooms[query], max_chunks
        ):
            ids += chunk_ids
            types += chunk_types
            lengths.append(len(chunk_ids))
            owners.append(i)
    type_ids = np.asarray(types, dtype=np.int64)
    kept_types = type_ids if encoder.use_types and type_ids.any() else None
    part = TokenSlice(
        0, np.asarray(ids, dtype=np.int64), np.asarray(lengths, dtype=np.int64), kept_types
    )
    return part, np.asarray(owners, dtype=np.int64)
