"""Where pipepool answers differently from a peer's OpenAPI document, and why: the reviewed list
the conformance suite (tests/test_conformance.py) holds every schemathesis finding against.

An entry names the peer, the operation as the document spells it ("POST /embed"; "*": every
claimed operation of the peer), the check (schemathesis's name, or ``answered_2xx``) and, for
response_schema_conformance, the response statuses it covers (``ERRORS``: the 4xx/5xx ones;
None: any). Two kinds:
- ``DELIBERATE``: pipepool does what the peer's server does, or refuses by name what it does
  not honour, where the document says otherwise (a document looser than its own server).
- ``PENDING``: a gap another part of the work closes (issue 56); such an entry is removed when
  that part lands, which the suite shows by reporting it as no longer found.
"""

from __future__ import annotations

from dataclasses import dataclass

DELIBERATE = "deliberate"
PENDING = "pending"


@dataclass(frozen=True)
class Deviation:
    """A finding the suite accepts: peer, operation ("*": all), check, kind and reason."""

    peer: str
    operation: str
    check: str
    kind: str
    reason: str
    statuses: tuple[int, ...] | None = None

    def matches(self, finding) -> bool:
        peer, operation, check = finding.key
        return (
            self.peer == peer
            and self.operation in ("*", operation)
            and self.check == check
            and (self.statuses is None or finding.status in self.statuses)
        )


ERRORS = tuple(range(400, 600))


def _d(
    peer: str,
    operation: str,
    check: str,
    reason: str,
    kind: str = DELIBERATE,
    statuses: tuple[int, ...] | None = None,
) -> Deviation:
    return Deviation(peer, operation, check, kind, reason, statuses)


_IDS_OUT = (
    "token ids outside the model's vocabulary are refused (422 / 400 naming the input): the "
    "document's schema allows any integer; TEI's router checks them too"
)
_NO_MODEL = "model may be left out when the server serves one model (vLLM's rule)"
_NO_BODY = "a request without a body has nothing to work on: refused (400), not answered empty"

DEVIATIONS: tuple[Deviation, ...] = (
    # -- TEI (docs/openapi.json v1.9.3) ---------------------------------------------------------
    *(
        _d("tei", op, "response_schema_conformance",
           "OpenAI's error body: /rerank and /tokenize are shared with vLLM, Jina and Cohere, "
           "whose clients read OpenAI's body (TEI's own routes answer TEI's)", statuses=ERRORS)
        for op in ("POST /rerank", "POST /tokenize")
    ),
    _d("tei", "POST /v1/embeddings", "response_schema_conformance",
       "TEI documents its own error body for its /v1/embeddings; pipepool answers OpenAI's "
       "there, as OpenAI's clients read it", statuses=ERRORS),
    *(
        _d("tei", op, "positive_data_acceptance", _IDS_OUT)
        for op in ("POST /embed", "POST /embed_all", "POST /embed_sparse", "POST /v1/embeddings",
                   "POST /decode")
    ),
    _d("tei", "POST /v1/embeddings", "status_code_conformance",
       "an unknown model name is a 404 (OpenAI's answer); TEI's document lists no 404"),
    _d("tei", "POST /tokenize", "positive_data_acceptance",
       "a prompt_name the model does not have is refused by name, never dropped"),
    _d("tei", "POST /similarity", "positive_data_acceptance",
       "a prompt_name the model does not have is refused by name, never dropped"),
    _d("tei", "POST /rerank", "positive_data_acceptance",
       "an empty texts list is refused (400), as TEI's router does (\"`texts` cannot be "
       "empty\"); its document allows it"),
    _d("tei", "POST /rerank", "negative_data_rejection",
       "truncation_direction: null is read as the field left out (its default, right)"),
    _d("tei", "POST /predict", "negative_data_rejection",
       "[\"text\"] is taken as a batch of one text, as TEI's router deserialises it; the "
       "document's schema wants each batch item an array"),
    _d("tei", "POST /predict", "positive_data_acceptance",
       "an empty text is refused (400 Empty), as TEI's router refuses it; its document allows "
       "it"),
    # -- OpenAI (openai-openapi openapi.yaml) ---------------------------------------------------
    _d("openai", "*", "status_code_conformance",
       "OpenAI's document lists only 200 (and 429 on /embeddings); pipepool answers errors "
       "(400, 401, 404) with OpenAI's error body and status, as OpenAI's API does"),
    _d("openai", "POST /embeddings", "positive_data_acceptance",
       "an empty input string is refused (400): the document's own description says input "
       "\"cannot be an empty string\", its schema does not"),
    _d("openai", "POST /embeddings", "negative_data_rejection",
       "model may be left out when the server serves one model (vLLM's rule)"),
    _d("openai", "GET /batches", "positive_data_acceptance",
       "limit outside 1..100 is refused (400): the range the document's description gives, "
       "which its schema does not enforce"),
    _d("openai", "GET /files", "positive_data_acceptance",
       "an empty purpose filter is refused (400)"),
    *(
        _d("openai", op, "response_schema_conformance",
           "null where there is none (first_id/last_id of an empty list, status_details): "
           "OpenAI's clients type these optional; the document marks none nullable")
        for op in ("GET /batches", "GET /files", "GET /files/{file_id}", "POST /files")
    ),
    _d("openai", "GET /files/{file_id}/content", "content_type_conformance",
       "a file's bytes are sent as application/octet-stream; the document says JSON"),
    _d("openai", "POST /batches", "positive_data_acceptance",
       "pipepool batches its own endpoints only (/v1/embeddings, /v1/rerank, ...): another "
       "endpoint (/v1/responses, /v1/videos, ...) is a 400"),
    _d("openai", "POST /batches", "answered_2xx",
       "a batch needs an uploaded file of this server's requests: generated ids name none "
       "(tests/test_batches.py covers creation)"),
    *(
        _d("openai", op, "answered_2xx",
           "a generated batch id names no batch: 404 (tests/test_batches.py covers the route)")
        for op in ("GET /batches/{batch_id}", "POST /batches/{batch_id}/cancel")
    ),
    _d("openai", "POST /files", "positive_data_acceptance",
       "a purpose other than batch is refused (400): the server keeps files for batches "
       "only"),
    # -- Cohere (cohere-openapi.yaml) -----------------------------------------------------------
    *(
        _d("cohere", op, "negative_data_rejection", _NO_MODEL)
        for op in ("POST /v1/tokenize", "POST /v1/detokenize")
    ),
    *(
        _d("cohere", op, "positive_data_acceptance", _NO_BODY)
        for op in ("POST /v1/tokenize", "POST /v1/detokenize")
    ),
    _d("cohere", "POST /v1/embed", "positive_data_acceptance",
       "text only: images and image inputs are refused by name (400)"),
    _d("cohere", "POST /v2/embed", "positive_data_acceptance",
       "images are embedded by dual encoders (CLIP, SigLIP) only, as data URIs, files under "
       "--allowed-local-media-path or URLs of --allowed-media-domains hosts: the text model "
       "served here refuses them (400), and content-part inputs are refused by name"),
    *(
        _d("cohere", op, "response_schema_conformance",
           "the document requires a top-level api_version that its properties do not define; "
           "pipepool answers meta.api_version, where Cohere's API and clients have it")
        for op in ("POST /v1/embed", "POST /v2/embed")
    ),
    _d("cohere", "POST /v2/rerank", "positive_data_acceptance",
       "an empty documents list and max_tokens_per_doc=0 are refused (400)"),
    _d("cohere", "GET /v1/models", "positive_data_acceptance",
       "what the document's descriptions call invalid is refused (400 naming it): page_size "
       "outside 1-1000 or not whole, default_only without endpoint"),
    _d("openai", "GET /models/{model}", "allow_header_conformance",
       "DELETE (deleting a fine-tuned model) is not served: pipepool serves no fine-tuned "
       "models; 405 with Allow: GET"),
)  # fmt: skip


def compare(peer: str, findings) -> tuple[list, list[Deviation]]:
    """(findings of ``peer`` no deviation covers, deviations of ``peer`` no finding shows)."""
    ours = [d for d in DEVIATIONS if d.peer == peer]
    unexpected = [f for f in findings if not any(d.matches(f) for d in ours)]
    stale = [d for d in ours if not any(d.matches(f) for f in findings)]
    return unexpected, stale
