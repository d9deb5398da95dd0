"""Hugging Face text-embeddings-inference's routes, so TEI clients (``huggingface_hub``'s
``InferenceClient.feature_extraction``, LangChain's and LlamaIndex's TEI classes) work as they
are: ``POST /embed`` (an array of vectors back) and ``GET /info`` here, and ``POST /tokenize``
with ``inputs`` (token objects back, ``tokens.py``). Errors keep the server's OpenAI error
body."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from ... import __version__
from .. import protocol
from .shared import ERRORS, READ_ERRORS, json_answer, run_model_outputs, select_model

router = APIRouter()


@router.post("/embed", tags=["TEI"], response_model=list[list[float]], responses=ERRORS)
async def embed(body: protocol.TEIEmbedRequest, request: Request) -> Response:
    """One vector per input, as a JSON array of arrays (TEI names no model: the server's only
    embedding model answers)."""
    select_model(request, None, "embed")
    done = await run_model_outputs(
        request,
        body.texts(),
        dimensions=body.dimensions,
        normalize=body.normalize,
        # TEI: truncate=false leaves the server's policy (its --auto-truncate) in charge.
        long_inputs="truncate" if body.truncate else None,
        truncation_side=body.truncation_direction.lower(),
        prompt_name=body.prompt_name,
    )
    if isinstance(done, Response):
        return done
    return await json_answer(
        request, lambda: [v.tolist() for v in done.outputs], sum(v.size for v in done.outputs)
    )


@router.get("/info", tags=["TEI"], responses=READ_ERRORS)
async def info(request: Request) -> dict:
    """What the model and the server's limits are (TEI's fields, and ``limits``: every limit
    on a request, by the flag that sets it). A server of several models describes the first
    it was given (``/v1/models`` lists them all)."""
    state = request.app.state.pipepool
    model = state.models.first
    engine = model.front.owner.engine
    out = {
        "model_id": model.name,
        "model_sha": None,
        "model_dtype": None,
        "model_type": {"embedding": {"pooling": None}},
        "max_concurrent_requests": model.front.max_queued,
        "max_input_length": None,
        "max_batch_tokens": None,
        "max_batch_requests": None,
        "max_client_batch_size": state.settings.max_inputs_per_request,
        "auto_truncate": None,
        "tokenization_workers": None,
        "version": __version__,
        "served_model_names": list(model.names.shown),
        "limits": {
            "max_inputs_per_request": state.settings.max_inputs_per_request,
            "max_tokens_per_request": state.settings.max_tokens_per_request,
            "max_chunked_tokens": state.settings.max_chunked_tokens,
            "max_body_bytes": state.settings.max_body_bytes,
            "max_queued_requests": model.front.max_queued,
        },
    }
    if engine is not None:
        d = engine.deployment
        model_type = {"embedding": {"pooling": d.pooling}}
        if d.classifier is not None:  # TEI names a one-label classifier a reranker
            kind = "reranker" if d.classifier.can_rerank else "classifier"
            labels = d.classifier.labels
            model_type = {
                kind: {
                    "id2label": {str(i): name for i, name in enumerate(labels)},
                    "label2id": {name: i for i, name in enumerate(labels)},
                }
            }
        out.update(
            model_dtype=str(d.dtype).removeprefix("torch."),
            model_type=model_type,
            max_input_length=d.max_model_len,
            max_batch_tokens=d.max_num_batched_tokens,
            max_batch_requests=d.config.max_num_seqs,
            auto_truncate=d.config.long_inputs == "truncate",
        )
    return out
