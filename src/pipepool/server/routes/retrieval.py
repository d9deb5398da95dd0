"""Sparse and multi-vector outputs over HTTP: TEI's ``POST /embed_sparse`` (SPLADE's vectors,
BGE-M3's lexical weights) here, and ``POST /v1/embeddings`` with ``outputs``
(``embedding_request.py`` builds its engine call with ``outputs_call`` below). Both wait for
``Engine.encode_outputs`` on a tokenising lane (``AsyncEngine.run_call``: one forward per input,
every output asked for from it), with the limits, error bodies, metrics and API key of
``/embed``.

Tokens per request are counted once the outputs are back (``encode_outputs`` tokenises and
computes in one call): a request over ``--max-tokens-per-request`` is answered 400 then, its
work done for nothing."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fastapi import APIRouter, Request, Response

from ...api.engine import Engine
from ...api.retrieval import RetrievalOutputs, check_outputs
from ...errors import PipepoolError
from ...loading.retrieval import OUTPUTS
from .. import protocol
from ..errors import APIError, from_engine
from ..limits import embedding_call
from ..tei_protocol import TEIEmbedSparseRequest, long_inputs_of
from .answers import json_answer
from .shared import check_task, model_of, run_engine, select_model, state_of
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
    inputs = tei_inputs(request, body.items())
    call = encode_call(
        inputs,
        ("sparse",),
        long_inputs=long_inputs_of(body.truncate),
        truncation_side=body.side(),
        prompt_name=body.prompt_name,
    )
    work = embedding_call(
        state_of(request).settings, model_of(request).front, inputs, {}, counted=call
    )
    done = await run_engine(request, work)
    if isinstance(done, Response):
        return done
    sparse = done.sparse
    assert sparse is not None, "asked for sparse outputs"
    size = sum(len(s.indices) for s in sparse)
    return await json_answer(request, lambda: protocol.tei_sparse_response(sparse), size)


def outputs_call(
    body: protocol.EmbeddingRequest, inputs: list, outputs: tuple[str, ...]
) -> Callable[[Engine], RetrievalOutputs]:
    """The engine call of ``/v1/embeddings`` asking for ``outputs`` (checked by
    ``check_model_outputs``), other than the dense vector alone; 400 for the options that
    apply to dense vectors only."""
    others = ", ".join(o for o in outputs if o != "dense")
    if not body.add_special_tokens:
        raise APIError(
            400,
            f"add_special_tokens false applies to dense embeddings only; {others} outputs are "
            "computed from the model's own input form",
            param="add_special_tokens",
            code="invalid_value",
        )
    if body.dimensions is not None:
        raise APIError(
            400,
            f"dimensions applies to dense embeddings only; it cannot be combined with {others} "
            "outputs",
            param="dimensions",
            code="invalid_value",
        )
    return encode_call(
        inputs,
        outputs,
        top_k=body.top_k,
        return_tokens=body.return_tokens,
        is_query=body.is_query,
        normalize=body.normalized,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
        truncation_side=body.truncation_side or "right",
        long_inputs=body.long_inputs,
    )


def outputs_size(done: RetrievalOutputs) -> int:
    """Numbers and indices of ``done``'s outputs: what its answer serialises."""
    size = sum(len(s.indices) for s in done.sparse or ())
    size += sum(m.size for m in done.multi_vector or ())
    return size + (done.dense.size if done.dense is not None else 0)


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


def encode_call(
    inputs: list, outputs: tuple[str, ...], *, long_inputs: str | None = None, **options
) -> Callable[[Engine], RetrievalOutputs]:
    """``Engine.encode_outputs(inputs, outputs, **options)``, for ``AsyncEngine.run_call``.
    ``long_inputs``: as asked, else the server's policy, chunking (which combines dense
    vectors only) read as truncation."""

    def call(engine: Engine) -> RetrievalOutputs:
        policy = long_inputs or engine.config.long_inputs
        if long_inputs is None and policy == "chunk":
            policy = "truncate"
        return engine.encode_outputs(inputs, outputs, long_inputs=policy, **options)

    return call
