"""The guards of an app with the Files API: ``POST /v1/files`` streams (its body is never
held whole: ``upload_stream.py`` writes it to disk as it comes) within its own size limit and
pace; every other request goes through ``guards.GuardMiddleware``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from .errors import APIError
from .guards import MIN_BODY_RATE, GuardMiddleware

__all__ = ["MULTIPART_SLACK", "UPLOAD_PATH", "UploadGuards"]

UPLOAD_PATH = "/v1/files"
# Room for the multipart framing around an upload of the largest allowed file: boundaries,
# part headers, the purpose field.
MULTIPART_SLACK = 64 << 10


class UploadGuards:
    """ASGI middleware: ``POST /v1/files`` is held to ``max_upload_bytes`` (and its multipart
    framing) and to the body pace of ``guards.py`` while the route reads it (a breach raises
    the 413 or 408 ``APIError`` from ``receive``, which the route's error handler answers);
    every other request to ``max_body_bytes``; the API key as for any request."""

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
        self.app = app
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
        if upload and scope["path"] == UPLOAD_PATH:
            await self.uploads.stream(scope, receive, send)
        else:
            await self.requests(scope, receive, send)


class _UploadGuard(GuardMiddleware):
    """The guard of uploads: the checks of ``GuardMiddleware`` on a body passed on as it
    arrives; its 413 names the batch file limit."""

    async def stream(self, scope, receive, send) -> None:
        refused = self._refused_by_headers(scope)
        if refused is not None:
            await self._reject(refused, scope, receive, send)
            return
        await self.app(scope, self._metered(receive), send)

    def _metered(self, receive):
        size, complete = 0, False
        started = time.monotonic()

        async def metered():
            nonlocal size, complete
            if complete:
                return await receive()  # after the body: the client's disconnect, whenever
            # As GuardMiddleware: no wait for a part past body_timeout_s, and the whole body
            # at MIN_BODY_RATE after the first body_timeout_s.
            late = started + self.body_timeout_s + size / MIN_BODY_RATE - time.monotonic()
            try:
                async with asyncio.timeout(max(0.0, min(self.body_timeout_s, late))):
                    message = await receive()
            except TimeoutError:
                raise self._too_slow() from None
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > self.max_body_bytes:
                    raise self._too_large()
                complete = not message.get("more_body", False)
            return message

        return metered

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"the upload is larger than the server's limit of {self.max_body_bytes} bytes "
            "(--max-batch-file-bytes and the form's framing); split the file into several "
            "batches",
            code="file_too_large",
            headers={"Connection": "close"},
        )
