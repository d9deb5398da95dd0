"""Checks made before the app parses anything: the API key (401) and the body size (413).

A plain ASGI middleware rather than a FastAPI dependency: an unauthenticated or oversized
request must be turned away before its body is buffered and parsed. The body is read here,
with the size counted as it arrives (a chunked upload has no Content-Length), and replayed
to the app; after it, the app's ``receive`` still reports the client's disconnect.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from .errors import AUTHENTICATION, APIError

# Open without a key: probes, scrapers and the API docs.
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/docs", "/docs/oauth2-redirect", "/openapi.json"})


class GuardMiddleware:
    def __init__(
        self,
        app,
        *,
        api_key: str | None,
        max_body_bytes: int,
        on_error: Callable[[APIError], None],
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.on_error = on_error

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])  # lower-case byte names, as ASGI guarantees
        if self.api_key is not None and scope["path"] not in PUBLIC_PATHS:
            err = self._check_key(headers.get(b"authorization"))
            if err is not None:
                await self._reject(err, scope, receive, send)
                return
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._reject(self._too_large(), scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its request: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._reject(self._too_large(), scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    def _check_key(self, header: bytes | None) -> APIError | None:
        assert self.api_key is not None, "checked only on a server that has a key"
        if header is None:
            message = "Missing API key: send the header 'Authorization: Bearer <key>'."
        else:
            scheme, _, token = header.partition(b" ")
            # compare_digest: the time taken must not tell how much of the key was right.
            if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key):
                return None
            message = "Incorrect API key provided."
        return APIError(
            401,
            message,
            type=AUTHENTICATION,
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"request body is larger than the server's limit of {self.max_body_bytes} bytes "
            "(--max-body-bytes); send fewer or shorter inputs per request",
            code="request_too_large",
            headers={"Connection": "close"},  # the rest of the body is not read
        )

    async def _reject(self, err: APIError, scope, receive, send) -> None:
        self.on_error(err)
        await err.response()(scope, receive, send)


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # blocks until the client disconnects (or the response ends)

    return replay
