"""``/v1/embeddings`` with Jina's ``late_chunking: true``: the request's texts are the chunks of
one document, embedded by ``api.late_chunking``'s rule in one engine call that waits for its
own results (a tokenising lane, the model's queue, its limits and errors)."""

from __future__ import annotations

from collections.abc import Callable

from ...api.engine import Engine
from ...api.late_chunking import late_chunk_texts
from .. import protocol
from ..errors import APIError
from ..front import Encoded


def late_chunks_call(body: protocol.EmbeddingRequest, chunks: list) -> Callable[[Engine], Encoded]:
    """The engine call giving each chunk's vector and the tokens it cost. Options late
    chunking cannot honour are a 400 naming them."""
    if not body.add_special_tokens:
        raise APIError(
            400,
            "late_chunking runs the document with the model's special tokens: "
            "add_special_tokens false does not apply",
            param="add_special_tokens",
            code="invalid_value",
        )

    def call(engine: Engine) -> Encoded:
        done = late_chunk_texts(
            engine,
            chunks,
            dimensions=body.dimensions,
            normalize=body.normalized,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
            truncation_side=body.truncation_side or "right",
            long_inputs=body.long_inputs,
        )
        return Encoded(done.vectors, done.num_tokens)

    return call
