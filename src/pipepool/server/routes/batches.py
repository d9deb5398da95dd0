"""OpenAI's Batches API: create a batch of an uploaded file, read it, list them, cancel one.

The routes only read and write the state directory's records (``batch_store.py``); the
server's main process runs the batches (``batch_runner.py``), in the background of online
requests, and resumes those a killed server left unfinished."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request

from ..batch_protocol import Batch, BatchList, CreateBatchRequest, page
from ..batch_store import CANCELLABLE
from ..errors import APIError
from .files import BODY_TOO_LARGE, BODY_TOO_SLOW, errors_doc, not_found, store_of

router = APIRouter(tags=["batches"])

_NO_BATCH = "No batch with this id."


@router.post(
    "/v1/batches",
    response_model=Batch,
    responses=errors_doc(
        e400="A bad field, or an input file not uploaded for batches.",
        e404="No input file with this id.",
        e408=BODY_TOO_SLOW,
        e413=BODY_TOO_LARGE,
    ),
)
async def create_batch(body: CreateBatchRequest, request: Request) -> Batch:
    """Run every line of an uploaded file (purpose 'batch') through ``endpoint``: the batch is
    ``validating``, then ``in_progress``, then ``completed`` with an output file (the answered
    requests) and an error file (the failed ones)."""
    store = store_of(request)
    source = store.file(body.input_file_id)
    if source is None:
        raise not_found("File", body.input_file_id, "input_file_id")
    if source.purpose != "batch":
        raise APIError(
            400,
            f"file {source.id} has purpose {source.purpose!r}: a batch reads a file uploaded "
            "with purpose 'batch'",
            param="input_file_id",
            code="invalid_value",
        )
    keep = body.output_expires_after
    record = store.create_batch(
        body.input_file_id,
        body.endpoint,
        body.completion_window,
        body.metadata,
        None if keep is None else keep.seconds,
    )
    return Batch.of(record)


@router.get(
    "/v1/batches/{batch_id}",
    response_model=Batch,
    responses=errors_doc(e404=_NO_BATCH),
)
async def retrieve_batch(batch_id: str, request: Request) -> Batch:
    """A batch: its status, timestamps, request counts and files."""
    record = store_of(request).batch(batch_id)
    if record is None:
        raise not_found("Batch", batch_id, "batch_id")
    return Batch.of(record)


@router.get(
    "/v1/batches",
    response_model=BatchList,
    responses=errors_doc(e400="A bad limit."),
)
async def list_batches(
    request: Request,
    after: str | None = Query(None, description="The last id of the previous page."),
    limit: int = Query(20, ge=1, le=100, description="Batches per page (1-100)."),
) -> BatchList:
    """Batches, newest first, a page at a time."""
    records, has_more = store_of(request).list_batches(after, limit)
    return BatchList(**page([Batch.of(r) for r in records], has_more))


@router.post(
    "/v1/batches/{batch_id}/cancel",
    response_model=Batch,
    responses=errors_doc(e404=_NO_BATCH, e409="The batch has ended or is ending already."),
)
async def cancel_batch(batch_id: str, request: Request) -> Batch:
    """Stop a batch: it is ``cancelling`` at once; no more of its requests are sent, those
    being answered finish, and it ends ``cancelled`` with the answers it has in its files."""
    store = store_of(request)
    if not store.move(batch_id, CANCELLABLE, "cancelling"):
        status = store.status(batch_id)
        if status is None:
            raise not_found("Batch", batch_id, "batch_id")
        if status not in ("cancelling", "cancelled"):
            raise APIError(
                409,
                f"Cannot cancel a batch with status {status!r}.",
                param="batch_id",
                code="invalid_state",
            )
    record = store.batch(batch_id)
    assert record is not None, batch_id
    return Batch.of(record)
