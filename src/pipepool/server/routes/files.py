"""OpenAI's Files API, as far as batches need it: upload a batch input file, list the files,
read a file's object and content (a batch's output and error files too), delete a file.
Records and bodies are in the server's state directory (``batch_store.py``), shared by every
front-end process.

Uploads may be as large as ``--max-batch-file-bytes`` (OpenAI's 200 MB), above the body
limit of every other route: ``UploadGuards`` holds each request to its own limit."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import python_multipart  # noqa: F401  # FastAPI parses forms with it: missing, cli names the extra
from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse, StreamingResponse
from pydantic import WithJsonSchema

from .. import protocol
from ..batch_protocol import (
    MAX_EXPIRY_S,
    MIN_EXPIRY_S,
    FileDeleted,
    FileList,
    FileObject,
    page,
)
from ..batch_store import BatchStore
from ..errors import APIError
from ..guards import GuardMiddleware

router = APIRouter(tags=["files"])

UPLOAD_PATH = "/v1/files"
# Room for the multipart framing around an upload of the largest allowed file: boundaries,
# part headers, the purpose field.
MULTIPART_SLACK = 64 << 10
_CHUNK = 1 << 20


KEY = "Missing or wrong API key (a server started with --api-key)."
NOT_FOUND = "No file with this id."
BODY_TOO_LARGE = "Request body larger than --max-body-bytes."
BODY_TOO_SLOW = "The request body did not arrive within --body-timeout."


def errors_doc(**meanings: str) -> dict[int | str, dict[str, Any]]:
    """Error answers for the OpenAPI schema, by status (``e404="..."``); every route may
    answer 401 (the API key) and 500."""
    meanings = {"e401": KEY, **meanings, "e500": "Internal error (the server's log says why)."}
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


# OpenAI's expires_after: its anchor and seconds come together or not at all.
_EXPIRY_PAIR = {
    "expires_after[anchor]": ["expires_after[seconds]"],
    "expires_after[seconds]": ["expires_after[anchor]"],
}


@router.post(
    UPLOAD_PATH,
    response_model=FileObject,
    responses=errors_doc(
        e400="Not multipart form data with a file and purpose 'batch'.",
        e408=BODY_TOO_SLOW,
        e413="The file is larger than --max-batch-file-bytes.",
    ),
    openapi_extra={
        "requestBody": {
            "content": {"multipart/form-data": {"schema": {"dependentRequired": _EXPIRY_PAIR}}}
        }
    },
)
async def create_file(
    request: Request,
    file: Annotated[UploadFile, File(description="The JSON Lines file.")],
    purpose: Annotated[str, Form(description="'batch'.", json_schema_extra={"enum": ["batch"]})],
    # A form field is there or not (never null): the schemas say so, so that no client sends
    # the text "null" for one.
    expires_anchor: Annotated[
        str | None,
        Form(
            alias="expires_after[anchor]",
            description="'created_at': the file is deleted expires_after[seconds] after it.",
        ),
        WithJsonSchema({"type": "string", "enum": ["created_at"]}),
    ] = None,
    expires_seconds: Annotated[
        int | None,
        Form(
            alias="expires_after[seconds]",
            ge=MIN_EXPIRY_S,
            le=MAX_EXPIRY_S,
            description="Seconds the file is kept (an hour to 30 days; default: until deleted).",
        ),
        WithJsonSchema({"type": "integer", "minimum": MIN_EXPIRY_S, "maximum": MAX_EXPIRY_S}),
    ] = None,
) -> FileObject:
    """Upload a batch input file (JSON Lines, one request per line), ``purpose="batch"``;
    with OpenAI's ``expires_after``, deleted that long after its upload."""
    if (expires_anchor is None) != (expires_seconds is None) or expires_anchor not in (
        None,
        "created_at",
    ):
        raise APIError(
            400,
            "expires_after takes anchor 'created_at' and seconds, both",
            param="expires_after",
            code="invalid_value",
        )
    if purpose != "batch":
        raise APIError(
            400,
            f"purpose {purpose!r} is not supported: this server stores batch input files "
            "only; send purpose 'batch'",
            param="purpose",
            code="invalid_value",
        )
    store = store_of(request)
    store.delete_expired()
    limit = request.app.state.pipepool.settings.max_batch_file_bytes
    file_id, part = store.new_upload()

    def copy() -> bool:
        """Whether the file was within the limit (written at ``part`` if so)."""
        size = 0
        with open(part, "wb") as out:
            while chunk := file.file.read(_CHUNK):
                size += len(chunk)
                if size > limit:
                    return False
                out.write(chunk)
        return True

    try:
        fits = await asyncio.to_thread(copy)  # off the loop: up to hundreds of megabytes
        if not fits:
            raise APIError(
                413,
                f"the file is larger than the server's limit of {limit} bytes for a batch "
                "file (--max-batch-file-bytes); split it into several batches",
                param="file",
                code="file_too_large",
            )
        record = store.add_file(file_id, part, filename=file.filename or "batch.jsonl",
                                purpose="batch", expires_after_s=expires_seconds)  # fmt: skip
    finally:
        part.unlink(missing_ok=True)
    return FileObject.of(record)


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
            handle = open(store.path(file_id), "rb")  # noqa: SIM115
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
    responses=errors_doc(e404=NOT_FOUND),
)
async def delete_file(file_id: str, request: Request) -> FileDeleted:
    """Delete a file (its record and its bytes)."""
    if not store_of(request).delete_file(file_id):
        raise not_found("File", file_id, "file_id")
    return FileDeleted(id=file_id)


class UploadGuards:
    """The guards (``guards.py``) of an app with the Files API: ``POST /v1/files`` is held to
    ``max_upload_bytes`` (and its multipart framing), every other request to
    ``max_body_bytes``; the API key and the other checks as for any request."""

    def __init__(
        self,
        app: Any,
        *,
        api_key: str | None,
        max_body_bytes: int,
        max_upload_bytes: int,
        body_timeout_s: float,
        on_error: Callable[[APIError], None],
    ) -> None:
        self.requests = GuardMiddleware(
            app, api_key=api_key, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s,
            on_error=on_error,
        )  # fmt: skip
        self.uploads = _UploadGuard(
            app, api_key=api_key, max_body_bytes=max_upload_bytes + MULTIPART_SLACK,
            body_timeout_s=body_timeout_s, on_error=on_error,
        )  # fmt: skip

    async def __call__(self, scope, receive, send) -> None:
        upload = scope["type"] == "http" and scope["method"] == "POST"
        guard = self.uploads if upload and scope["path"] == UPLOAD_PATH else self.requests
        await guard(scope, receive, send)


class _UploadGuard(GuardMiddleware):
    """The guard of uploads: its 413 names the batch file limit."""

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"the upload is larger than the server's limit of {self.max_body_bytes} bytes "
            "(--max-batch-file-bytes and the form's framing); split the file into several "
            "batches",
            code="file_too_large",
            headers={"Connection": "close"},
        )
