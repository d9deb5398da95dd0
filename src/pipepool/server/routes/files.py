"""OpenAI's Files API, as far as batches need it: upload a batch input file, list the files,
read a file's object and content (a batch's output and error files too), delete a file.
Records and bodies are in the server's state directory (``batch_store.py``), shared by every
front-end process.

Uploads may be as large as ``--max-batch-file-bytes`` (OpenAI's 200 MB), above the body
limit of every other route: ``UploadGuards`` holds each request to its own limit, and the
upload streams to disk (``upload_stream.py``). A storage fault answers 507 (disk full) or 503
with the reason (``store_faults.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, StreamingResponse

from .. import protocol
from ..batch_protocol import (
    MAX_EXPIRY_S,
    MIN_EXPIRY_S,
    FileDeleted,
    FileList,
    FileObject,
    page,
)
from ..batch_store import BatchStore, FileInUse, StoreUnavailable
from ..errors import APIError
from ..upload_guard import UPLOAD_PATH
from ..upload_slots import upload_slot
from ..upload_stream import FormSpec, ReceivedForm, receive_form

__all__ = ["router", "store_of"]

router = APIRouter(tags=["files"])

_CHUNK = 1 << 20


KEY = "Missing or wrong API key (a server started with --api-key)."
NOT_FOUND = "No file with this id."
BODY_TOO_LARGE = "Request body larger than --max-body-bytes."
BODY_TOO_SLOW = "The request body did not arrive within --body-timeout."
STORE_FAULT = "The batch store cannot be used now (an I/O error, a damaged database): the reason."
STORE_FULL = "The state directory's disk is full: free space there, then retry."


def errors_doc(**meanings: str) -> dict[int | str, dict[str, Any]]:
    """Error answers for the OpenAPI schema, by status (``e404="..."``); every route may
    answer 401 (the API key), 500, and 503 or 507 (a storage fault)."""
    meanings = {
        "e401": KEY, **meanings, "e500": "Internal error (the server's log says why).",
        "e503": STORE_FAULT, "e507": STORE_FULL,
    }  # fmt: skip
    return {
        int(status[1:]): {"model": protocol.ErrorResponse, "description": meaning}
        for status, meaning in sorted(meanings.items())
    }


def store_of(request: Request) -> BatchStore:
    """The app's store of files and batches, opened on first use (an app that never serves
    these routes makes no state directory)."""
    state = request.app.state
    store = getattr(state, "batch_store", None)
    if store is None:
        store = state.batch_store = BatchStore(state.pipepool.settings.batch_state_dir)
    return store


def not_found(kind: str, name: str, param: str) -> APIError:
    return APIError(404, f"No such {kind} object: {name}", param=param, code="not_found")


# The upload form, as OpenAI's: the file, its purpose, and an optional expiry whose anchor and
# seconds come together or not at all. Read by ``upload_stream.py`` (any other field is
# refused by name), documented here.
_ANCHOR, _SECONDS = "expires_after[anchor]", "expires_after[seconds]"
_UPLOAD_FORM = {
    "type": "object",
    "required": ["file", "purpose"],
    "properties": {
        "file": {"type": "string", "format": "binary", "description": "The JSON Lines file."},
        "purpose": {"type": "string", "enum": ["batch"], "description": "'batch'."},
        _ANCHOR: {
            "type": "string",
            "enum": ["created_at"],
            "description": "'created_at': the file is deleted expires_after[seconds] after it.",
        },
        _SECONDS: {
            "type": "integer",
            "minimum": MIN_EXPIRY_S,
            "maximum": MAX_EXPIRY_S,
            "description": "Seconds the file is kept (an hour to 30 days; default: until deleted).",
        },
    },
    "additionalProperties": False,
    "dependentRequired": {_ANCHOR: [_SECONDS], _SECONDS: [_ANCHOR]},
}


@router.post(
    UPLOAD_PATH,
    response_model=FileObject,
    responses=errors_doc(
        e400="Not multipart form data with a file and purpose 'batch', or a field this route "
        "does not take.",
        e408=BODY_TOO_SLOW,
        e413="The file is larger than --max-batch-file-bytes.",
        e429="--max-concurrent-uploads uploads are being received; retry after Retry-After.",
    ),
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"multipart/form-data": {"schema": _UPLOAD_FORM}},
        }
    },
)
async def create_file(request: Request) -> FileObject:
    """Upload a batch input file (JSON Lines, one request per line), ``purpose="batch"``;
    with OpenAI's ``expires_after``, deleted that long after its upload. The file is written
    to the state directory as it arrives (a few megabytes of memory whatever its size); at most
    ``--max-concurrent-uploads`` are received at once."""
    settings = request.app.state.pipepool.settings
    store = store_of(request)
    _check_room(store, request.headers.get("content-length"))
    async with upload_slot(request.app, settings):
        file_id, part = store.new_upload()
        try:
            form = await _receive(request, store, part, settings.max_batch_file_bytes)
            expiry = _expiry(form.fields)
            _check_purpose(form.fields)
            store.delete_expired()
            record = store.add_file(
                file_id, part, filename=form.filename or "batch.jsonl", purpose="batch",
                expires_after_s=expiry,
            )  # fmt: skip
        finally:
            part.unlink(missing_ok=True)
    return FileObject.of(record)


async def _receive(request: Request, store: BatchStore, part: Path, limit: int) -> ReceivedForm:
    """The upload's form; its file written (and synced) at ``part``."""
    spec = FormSpec("file", frozenset({"purpose", _ANCHOR, _SECONDS}), limit,
                    lambda: _file_too_large(limit))  # fmt: skip
    fd = store.opened(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:

        async def write(data: bytes) -> None:  # off the loop: a slow disk holds no request
            await asyncio.to_thread(store.append, fd, data)

        try:
            form = await receive_form(
                request.headers.get("content-type", ""), request.stream(), spec, write
            )
        except StoreUnavailable as fault:  # the rest of the body is not read
            fault.headers = {**(fault.headers or {}), "Connection": "close"}
            raise
        if form.filename is None:
            raise APIError(400, "the form has no 'file' part", param="file",
                           code="missing_required_parameter")  # fmt: skip
        # On disk before its record says it is there: a crash never leaves a shorter file.
        await asyncio.to_thread(store.sync, fd)
    finally:
        os.close(fd)
    return form


def _expiry(fields: dict[str, str]) -> int | None:
    """OpenAI's ``expires_after``: seconds to keep the file (None: until deleted)."""
    anchor, seconds = fields.get(_ANCHOR), fields.get(_SECONDS)
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at" or seconds is None:
        raise APIError(
            400,
            "expires_after takes anchor 'created_at' and seconds, both",
            param="expires_after",
            code="invalid_value",
        )
    value = int(seconds) if seconds.strip().isdigit() else None
    if value is None or not MIN_EXPIRY_S <= value <= MAX_EXPIRY_S:
        raise APIError(
            400,
            f"expires_after[seconds] must be a whole number of seconds from {MIN_EXPIRY_S} to "
            f"{MAX_EXPIRY_S} (an hour to 30 days), not {seconds!r}",
            param="expires_after",
            code="invalid_value",
        )
    return value


def _check_purpose(fields: dict[str, str]) -> None:
    purpose = fields.get("purpose")
    if purpose is None:
        raise APIError(400, "the form has no 'purpose' field; send purpose 'batch'",
                       param="purpose", code="missing_required_parameter")  # fmt: skip
    if purpose != "batch":
        raise APIError(
            400,
            f"purpose {purpose!r} is not supported: this server stores batch input files "
            "only; send purpose 'batch'",
            param="purpose",
            code="invalid_value",
        )


def _check_room(store: BatchStore, declared: str | None) -> None:
    """507 at once for an upload the state directory has no room for (its Content-Length
    against the free space), before its body is read."""
    if declared is None or not declared.isdigit():
        return
    free = store.free_bytes()
    if free is not None and int(declared) > free:
        fault = StoreUnavailable(
            f"{store.dir} has {free} bytes free, the upload is {declared} bytes", full=True
        )
        fault.headers = {**(fault.headers or {}), "Connection": "close"}  # body left unread
        raise fault


def _file_too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the file is larger than the server's limit of {limit} bytes for a batch "
        "file (--max-batch-file-bytes); split it into several batches",
        param="file",
        code="file_too_large",
        headers={"Connection": "close"},  # the rest of the body is not read
    )


@router.get(UPLOAD_PATH, response_model=FileList, responses=errors_doc(e400="A bad parameter."))
async def list_files(
    request: Request,
    purpose: str | None = Query(
        None,
        description="Only files of this purpose.",
        json_schema_extra={"enum": ["batch", "batch_output"]},
    ),
    after: str | None = Query(None, description="The last id of the previous page."),
    limit: int = Query(10000, ge=1, le=10000, description="Files per page (1-10000)."),
    order: str = Query(
        "desc",
        description="By creation: desc (newest first) or asc.",
        json_schema_extra={"enum": ["asc", "desc"]},
    ),
) -> FileList:
    """The stored files (uploads and batches' output and error files), a page at a time."""
    if purpose not in (None, "batch", "batch_output"):
        raise APIError(400, f"purpose must be batch or batch_output, not {purpose!r}",
                       param="purpose", code="invalid_value")  # fmt: skip
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be asc or desc, not {order!r}", param="order",
                       code="invalid_value")  # fmt: skip
    store = store_of(request)
    store.delete_expired()
    records, has_more = store.list_files(purpose, after, limit, newest_first=order == "desc")
    return FileList(**page([FileObject.of(r) for r in records], has_more))


@router.get(
    UPLOAD_PATH + "/{file_id}",
    response_model=FileObject,
    responses=errors_doc(e404=NOT_FOUND),
)
async def retrieve_file(file_id: str, request: Request) -> FileObject:
    """A file's object: its size, name, purpose."""
    record = store_of(request).file(file_id)
    if record is None:
        raise not_found("File", file_id, "file_id")
    return FileObject.of(record)


@router.get(
    UPLOAD_PATH + "/{file_id}/content",
    response_class=FileResponse,
    responses=errors_doc(e404=NOT_FOUND),
)
async def file_content(file_id: str, request: Request) -> StreamingResponse:
    """A file's bytes (a batch's output file: one JSON line per request)."""
    store = store_of(request)
    # Opened here: a file deleted while its bytes are sent is still read whole, and one
    # deleted before is a 404 (a path checked now and read later would be a 500). The
    # response closes it.
    handle = None
    if store.file(file_id) is not None:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            # Through the store: an I/O error is a storage fault (503), not a 500.
            handle = os.fdopen(store.opened(store.path(file_id), os.O_RDONLY), "rb")
    if handle is None:
        raise not_found("File", file_id, "file_id")
    size = os.fstat(handle.fileno()).st_size

    def chunks() -> Iterator[bytes]:
        with handle:
            while chunk := handle.read(_CHUNK):
                yield chunk

    return StreamingResponse(
        chunks(), media_type="application/octet-stream", headers={"Content-Length": str(size)}
    )


@router.delete(
    UPLOAD_PATH + "/{file_id}",
    response_model=FileDeleted,
    responses=errors_doc(
        e404=NOT_FOUND,
        e409="The file is the input of a batch that has not ended; the batch is named.",
    ),
)
async def delete_file(file_id: str, request: Request) -> FileDeleted:
    """Delete a file (its record and its bytes). The input file of a batch that has not ended
    (validating, in progress, finalizing, cancelling) is kept until it ends: 409."""
    try:
        deleted = store_of(request).delete_file(file_id)
    except FileInUse as used:
        raise APIError(
            409,
            f"file {file_id} is the input of batch {used.batch_id}, which is {used.status}: "
            "it can be deleted once the batch ends (or cancel the batch first)",
            param="file_id",
            code="file_in_use",
        ) from None
    if not deleted:
        raise not_found("File", file_id, "file_id")
    return FileDeleted(id=file_id)
