"""The rule every request body of the HTTP API follows for fields it does not know.

pipepool refuses what it does not honour: a field a request model does not declare is a 400,
``Unrecognized request argument supplied: NAME`` (every unknown field named, OpenAI's own
words), never parsed and dropped. A field that changed nothing here would be a silent lie:
``truncation_side`` or ``endianness`` ignored gives a vector the client did not ask for.

What each peer does, and where pipepool stands (one rule, stated here):

- OpenAI (``/v1/embeddings``): 400 ``Unrecognized request argument supplied``. The same.
- vLLM (``/pooling``, ``/tokenize``, ``/detokenize``, ``/score``, ``/classify``, ``/rerank``):
  vLLM takes any field and logs a warning naming those it ignored. pipepool answers 400: each
  field of vLLM's that pipepool serves is declared with vLLM's meaning; the others are
  refused by name instead of ignored.
- TEI (``/embed``, ``/embed_sparse``, ``/tokenize``'s ``inputs`` form, ``/rerank``'s
  ``texts`` form): TEI's serde structs ignore unknown fields. pipepool answers 400, for the
  same reason.
- Cohere (``/v2/embed``, ``/rerank``): 400, as for the others.

A route family that must take a field it does not act on (a real client sends it, and it
cannot change an answer) names it in ``tolerated`` with the reason; such a field is read and
set aside before validation, and is the only kind ever dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

log = logging.getLogger("pipepool.server")


class StrictRequest(BaseModel):
    """A request body that takes the fields it declares and no other: an unknown field fails
    validation (``extra_forbidden``), which the server answers 400 naming every such field
    (``errors.py``). ``tolerated``: the only exceptions, field name -> why taking it without
    acting on it cannot change an answer; empty unless a subclass says otherwise."""

    model_config = ConfigDict(extra="forbid")

    tolerated: ClassVar[Mapping[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _set_aside_tolerated(cls, data: Any) -> Any:
        if not cls.tolerated or not isinstance(data, dict):
            return data
        kept = {k: v for k, v in data.items() if k not in cls.tolerated}
        if len(kept) < len(data):
            log.debug("tolerated request fields: %s", ", ".join(sorted(set(data) - set(kept))))
        return kept
