"""vLLM's ``POST /pooling``: what its ``task`` names, of any model that does it
(``pooling_tasks.py``): pooled vectors and token vectors of an embedding model, label
probabilities per input of a sequence classifier and per token of a token classifier. The
same limits, errors, metrics and API key as ``/v1/embeddings``; answers in vLLM's shape, as
JSON or as vLLM's bytes."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Request, Response

from ...api.vlm import PAGE_FAMILIES
from ...errors import PipepoolError
from ..errors import APIError, from_engine
from ..fast_route import FastBodyRoute
from ..front import Encoded
from ..limits import bounded_scoring, check_input_count, check_inputs
from ..models import ServedModel
from ..pooling_protocol import PoolingRequest, PoolingResponse, answer_head
from ..pooling_tasks import EMBEDDING_TASKS, TASKS_OF, pooling_tasks
from ..protocol import list_response
from .answers import binary_answer, json_answer
from .chat_embeddings import embed_messages
from .openai import VECTOR_ANSWERS
from .page_retrievers import refuse_page_retriever, vlm_family
from .shared import (
    CLIENT_CLOSED,
    ERRORS,
    ClientGone,
    check_task,
    run_engine,
    run_model_outputs,
    select_model,
    state_of,
    unless_client_leaves,
)
from .vlm_calls import query_call

router = APIRouter(route_class=FastBodyRoute)

# vLLM's classification tasks as pipepool's (``api.routing.TASKS``).
_CLASSIFIER_TASKS = {"classify": "classify", "token_classify": "classify_tokens"}
# What each task answers per input, as a refusal names it.
_ANSWERS = {
    "embed": "one vector",
    "classify": "label probabilities",
    "token_classify": "label probabilities per token",
}


@router.post("/pooling", response_model=PoolingResponse, responses={**ERRORS, 200: VECTOR_ANSWERS})
async def pooling(body: PoolingRequest, request: Request) -> Response:
    """vLLM's pooling API: per input, what ``task`` computes (default: the model's task) —
    embed: its vector; token_embed: ``[num_tokens, hidden]``; classify: its label
    probabilities; token_classify: ``[num_tokens, num_labels]``."""
    model = select_model(request, body.model, *_routing_tasks(body.task))
    task = _task(model, body.task)
    pages = vlm_family(model) in PAGE_FAMILIES
    if task in EMBEDDING_TASKS:
        token_embed = task == "token_embed"
        # a page retriever's token vectors are its embeddings: normalised, as it makes them
        normalize = bool(body.normalized) if token_embed and not pages else body.normalized
        if pages and body.messages is None:  # queries: the retriever's processor's format
            done = await run_engine(request, query_call(request, body, normalize))
        elif body.messages is not None:  # vLLM's chat form: one input
            done = await embed_messages(
                request, body, pooling="all" if token_embed else None, normalize=normalize
            )
        else:
            done = await run_model_outputs(
                request,
                body.inputs(),
                truncate_prompt_tokens=body.truncate_prompt_tokens,
                truncation_side=body.truncation_side or "right",
                long_inputs=body.long_inputs,
                add_special_tokens=body.add_special_tokens,
                pooling="all" if token_embed else None,
                normalize=normalize,
            )
    else:
        done = await _classified(request, model, body, task)
    if isinstance(done, Response):
        return done
    outputs = [np.asarray(out, dtype=np.float32) for out in done.outputs]
    head = {**answer_head("pooling"), "model": model.names.response_name(body.model)}
    if body.wire.binary:
        return await binary_answer(request, outputs, body.wire, head, done.num_tokens)
    return await json_answer(
        request,
        lambda: list_response(
            head["model"], "pooling", "data", outputs, done.num_tokens, body.wire, head
        ),
        sum(out.size for out in outputs),
    )


def _routing_tasks(asked: str | None) -> tuple[str, ...]:
    """What a request of /pooling's ``task`` needs of a model (``api.routing.TASKS``), for
    the shared routing rule; none for no task (the model's own), nor for one /pooling does not
    have (``_task`` refuses it, naming the chosen model's tasks)."""
    return tuple(t for t, does in TASKS_OF.items() if asked in does)


def _task(model: ServedModel, asked: str | None) -> str:
    """The task a request runs: ``asked``, or the model's own; 400 for one it does not do,
    404 where it does none (503 while it loads)."""
    try:
        architecture = model.front.engine.info.architecture
    except PipepoolError as exc:  # loading, or failed to start
        raise from_engine(exc) from None
    does = pooling_tasks(model.tasks() or ())
    if not does:
        what = ", ".join(model.tasks() or ()) or "nothing"
        raise APIError(
            404,
            f"model {model.name} ({architecture}) does none of /pooling's tasks (embed, "
            f"token_embed, classify, token_classify); what it does: {what}",
            param="model",
            code="unsupported_task",
        )
    pages = vlm_family(model) in PAGE_FAMILIES  # token vectors are its embeddings
    if pages:
        does = ("token_embed",)
    task = asked if asked is not None else does[0]
    if pages and task in _ANSWERS:
        refuse_page_retriever(model, f"/pooling's task {task} answers {_ANSWERS[task]}", "task")
    if task not in does:
        raise APIError(
            400,
            f"task {task} is not one model {model.name} does; its tasks: {', '.join(does)}",
            param="task",
            code="unsupported_task",
        )
    return task


async def _classified(
    request: Request, model: ServedModel, body: PoolingRequest, task: str
) -> Encoded | Response:
    """Label probabilities of the inputs (``Engine.submit_classify``), per token for
    token_classify, within the server's limits; a bare Response (499) if the client left."""
    if body.normalize is not None:
        raise APIError(
            400,
            f"normalize applies to embed and token_embed, not to task {task} (its "
            "activation is use_activation)",
            param="normalize",
            code="invalid_value",
        )
    if not body.add_special_tokens:
        raise APIError(
            400,
            f"add_special_tokens false is not offered for task {task}: a classifier was "
            "trained on inputs with its special tokens",
            param="add_special_tokens",
            code="invalid_value",
        )
    state, texts = state_of(request), body.inputs()
    check_task(model, _CLASSIFIER_TASKS[task])
    check_inputs(state.settings, texts)
    if not all(isinstance(t, str) for t in texts):
        raise APIError(400, f"task {task} takes texts, not token ids", param="input")
    check_input_count(state.settings, len(texts), "input")
    submit = bounded_scoring(
        state.settings,
        len(texts),
        body.truncate_prompt_tokens,
        lambda engine: engine.submit_classify(
            texts,
            use_activation=body.use_activation is not False,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
            truncation_side=body.truncation_side or "right",
            long_inputs=body.long_inputs,
            per_token=task == "token_classify",
        ),
        "input",
    )
    try:
        return await unless_client_leaves(request, model.front.run(len(texts), submit, texts))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
