"""Sparse and multi-vector outputs over HTTP: TEI's ``POST /embed_sparse`` (SPLADE's vectors,
BGE-M3's lexical weights) here, and ``POST /v1/embeddings`` with ``outputs`` (``openai.py``
hands such requests to ``embeddings`` below). Both wait for ``Engine.encode_outputs`` on a
tokenising lane (``AsyncEngine.run_call``: one forward per input, every output asked for from
it), with the limits, error bodies, metrics and API key of ``/embed``.

Tokens per request are counted once the outputs are back (``encode_outputs`` tokenises and
computes in one call): a request over ``--max-tokens-per-request`` is answered 400 then, its
work done for nothing."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import APIRouter, Request, Response

from ...api.engine import Engine
from ...api.retrieval import RetrievalOutputs, check_outputs
from ...errors import PipepoolError
from ...loading.retrieval import OUTPUTS
from .. import protocol
from ..errors import APIError, from_engine
from ..limits import too_many_tokens
from ..tei_protocol import TEIEmbedSparseRequest, long_inputs_of
from .shared import (
    check_task,
    json_answer,
    model_of,
    run_model_call,
    select_model,
    state_of,
)
from .tei import TEI_ERRORS, tei_inputs

router = APIRouter()


@router.post(
    "/embed_sparse",
    tags=["TEI"],
    response_model=list[list[protocol.TEISparseValue]],
    responses=TEI_ERRORS,
)
async def embed_sparse(body: TEIEmbedSparseRequest, request: Request) -> Response:
    """One sparse vector per input, as TEI answers: its non-zeros as ``{index, value}``,
    indices ascending (SPLADE models; BGE-M3's lexical weights)."""
    check_task(select_model(request, None, "sparse"), "sparse")
    check_model_outputs(request, ["sparse"])
    done = await encode(
        request,
        tei_inputs(request, body.items()),
        ("sparse",),
        long_inputs=long_inputs_of(body.truncate),
        truncation_side=body.side(),
        prompt_name=body.prompt_name,
    )
    if isinstance(done, Response):
        return done
    sparse = done.sparse
    assert sparse is not None, "asked for sparse outputs"
    size = sum(len(s.indices) for s in sparse)
    return await json_answer(request, lambda: protocol.tei_sparse_response(sparse), size)


async def embeddings(
    body: protocol.EmbeddingRequest, request: Request, outputs: tuple[str, ...]
) -> Response:
    """``/v1/embeddings`` asking for ``outputs`` (checked by ``check_model_outputs``), other
    than the dense vector alone."""
    if not body.add_special_tokens:
        raise APIError(
            400,
            f"add_special_tokens false applies to dense embeddings only; "
            f"{', '.join(o for o in outputs if o != 'dense')} outputs are computed from the "
            "model's own input form",
            param="add_special_tokens",
            code="invalid_value",
        )
    if body.dimensions is not None:
        raise APIError(
            400,
            "dimensions applies to dense embeddings only; it cannot be combined with "
            f"{', '.join(o for o in outputs if o != 'dense')} outputs",
            param="dimensions",
            code="invalid_value",
        )
    done = await encode(
        request,
        body.inputs(),
        outputs,
        top_k=body.top_k,
        return_tokens=body.return_tokens,
        is_query=body.is_query,
        normalize=body.normalized,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
        truncation_side=body.truncation_side or "right",
        long_inputs=body.long_inputs,
    )
    if isinstance(done, Response):
        return done
    name = model_of(request).names.response_name(body.model)
    size = sum(len(s.indices) for s in done.sparse or ())
    size += sum(m.size for m in done.multi_vector or ())
    size += done.dense.size if done.dense is not None else 0
    return await json_answer(
        request,
        lambda: protocol.outputs_response(name, done, body.wire),
        size,
    )


def task_of(output: str) -> str:
    """The task (``api.routing.TASKS``) of giving ``output``."""
    return "embed" if output == "dense" else output


def check_model_outputs(request: Request, asked: Sequence[str]) -> tuple[str, ...]:
    """The outputs asked for, in ``OUTPUTS`` order: 400 for a name that is none and for one
    the request's model does not give (naming those it gives), 404 for a model that gives
    none (``check_task``: it serves no embeddings), 503 while it loads."""
    model = model_of(request)
    try:
        given = model.front.engine.info.outputs
    except PipepoolError as exc:  # loading, or failed to start
        raise from_engine(exc) from None
    offered = model.tasks() or ()
    gives = [o for o in OUTPUTS if task_of(o) in offered]
    if not gives:
        check_task(model, "embed")
    missing = [o for o in dict.fromkeys(asked) if o in OUTPUTS and o not in gives]
    if missing:
        raise APIError(
            400,
            f"model {model.name} does not give {', '.join(missing)} outputs; it gives "
            f"{', '.join(gives)}",
            param="outputs",
            code="unsupported_output",
        )
    try:
        return check_outputs(given, asked)
    except PipepoolError as exc:  # InvalidInputError: a name that is no output
        raise from_engine(exc) from None


async def encode(
    request: Request,
    inputs: list,
    outputs: tuple[str, ...],
    *,
    long_inputs: str | None = None,
    **options,
) -> RetrievalOutputs | Response:
    """``Engine.encode_outputs(inputs, outputs, **options)`` within the server's limits; a
    bare Response (499) if the client left meanwhile. ``long_inputs``: as asked, else the
    server's policy, chunking (which combines dense vectors only) read as truncation."""
    settings = state_of(request).settings

    def call(engine: Engine) -> RetrievalOutputs:
        policy = long_inputs or engine.config.long_inputs
        if long_inputs is None and policy == "chunk":
            policy = "truncate"
        out = engine.encode_outputs(inputs, outputs, long_inputs=policy, **options)
        total = int(sum(out.num_tokens))
        if total > settings.max_tokens_per_request:
            raise too_many_tokens(settings, total, "input")
        return out

    return await run_model_call(request, inputs, call)
