"""Request and response bodies of OpenAI's Files and Batches APIs (``routes/files.py``,
``routes/batches.py``), field for field as OpenAI sends them, so that the official clients
parse them and /openapi.json documents them."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, Field, StrictStr, field_validator

from ..jobs.batch_lines import ENDPOINTS
from .batch_store import BatchRecord, FileRecord
from .openapi import Integer

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
    "cancelled",
]  # fmt: skip
Endpoint = Literal[
    "/v1/embeddings", "/v1/rerank", "/v1/score", "/v1/classify", "/v1/embed", "/v2/embed"
]
assert set(get_args(Endpoint)) == set(ENDPOINTS), "one list of the routes a batch may call"


class FileObject(BaseModel):
    """An uploaded file (purpose ``batch``) or a batch's output or error file
    (``batch_output``)."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed"] = "processed"
    status_details: str | None = None
    expires_at: int | None = None

    @classmethod
    def of(cls, record: FileRecord) -> FileObject:
        return cls(
            id=record.id,
            bytes=record.bytes,
            created_at=record.created_at,
            filename=record.filename,
            purpose=record.purpose,  # type: ignore[arg-type]  # the store writes only these
            expires_at=record.expires_at,
        )


def page(data: list, has_more: bool) -> dict[str, Any]:
    """The fields of OpenAI's page of a list (``FileList``, ``BatchList``) holding ``data``."""
    return {
        "data": data,
        "first_id": data[0].id if data else None,
        "last_id": data[-1].id if data else None,
        "has_more": has_more,
    }


class FileList(BaseModel):
    """OpenAI's page of files; ``after`` the last id to read the next page."""

    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


# OpenAI's limits on metadata, checked by the validator below and stated in the schema.
_Metadata = Annotated[
    dict[StrictStr, Annotated[StrictStr, Field(json_schema_extra={"maxLength": 512})]],
    Field(json_schema_extra={"maxProperties": 16, "propertyNames": {"maxLength": 64}}),
]


# OpenAI's bounds on how long a file is kept: an hour to 30 days.
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 24 * 3600


class ExpiresAfter(BaseModel):
    """OpenAI's expiry of a file: ``seconds`` after its creation (the only anchor)."""

    anchor: Literal["created_at"]
    seconds: Integer = Field(ge=MIN_EXPIRY_S, le=MAX_EXPIRY_S)


class CreateBatchRequest(BaseModel):
    """``POST /v1/batches``."""

    input_file_id: StrictStr = Field(description="A file uploaded with purpose 'batch'.")
    endpoint: Endpoint = Field(description="The route every line of the file calls.")
    completion_window: Literal["24h"] = Field(
        description="A batch not finished this long after it was created expires."
    )
    metadata: _Metadata | None = Field(
        None, description="Up to 16 pairs, keys up to 64 characters, values up to 512."
    )
    output_expires_after: ExpiresAfter | None = Field(
        None,
        description="The batch's output and error files are deleted this long after they are "
        "made (default: kept until deleted).",
    )

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if len(value) > 16:
            raise ValueError("at most 16 pairs")
        if any(len(k) > 64 for k in value) or any(len(v) > 512 for v in value.values()):
            raise ValueError("keys are at most 64 characters, values at most 512")
        return value


class BatchRequestCounts(BaseModel):
    total: int
    completed: int = Field(description="Requests answered with a 2xx (the output file).")
    failed: int = Field(description="Requests in the error file.")


class BatchError(BaseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchUsage(BaseModel):
    """OpenAI's token usage of a batch: the prompt tokens its answered requests read (a
    pooling model writes no tokens)."""

    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int = 0
    output_tokens_details: dict[str, int]
    total_tokens: int

    @classmethod
    def of(cls, tokens: int) -> BatchUsage:
        return cls(
            input_tokens=tokens,
            input_tokens_details={"cached_tokens": 0},
            output_tokens_details={"reasoning_tokens": 0},
            total_tokens=tokens,
        )


class Batch(BaseModel):
    """A batch, OpenAI's object: its status, timestamps, counts and files."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts
    usage: BatchUsage
    metadata: dict[str, str] | None = None

    @classmethod
    def of(cls, r: BatchRecord) -> Batch:
        errors = None
        if r.errors is not None:
            errors = BatchErrors(data=[BatchError(**e) for e in json.loads(r.errors)])
        return cls(
            id=r.id, endpoint=r.endpoint, errors=errors, input_file_id=r.input_file_id,
            completion_window=r.completion_window, status=r.status,  # type: ignore[arg-type]
            output_file_id=r.output_file_id, error_file_id=r.error_file_id,
            created_at=r.created_at, in_progress_at=r.in_progress_at, expires_at=r.expires_at,
            finalizing_at=r.finalizing_at, completed_at=r.completed_at, failed_at=r.failed_at,
            expired_at=r.expired_at, cancelling_at=r.cancelling_at, cancelled_at=r.cancelled_at,
            request_counts=BatchRequestCounts(total=r.total, completed=r.completed,
                                              failed=r.failed),
            usage=BatchUsage.of(r.input_tokens),
            metadata=None if r.metadata is None else json.loads(r.metadata),
        )  # fmt: skip


class BatchList(BaseModel):
    """OpenAI's page of a list: newest first; ``after`` the last id to read the next page."""

    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool
