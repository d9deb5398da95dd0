"""Checks made before the app parses anything: the API key (401), the body size (413), how
fast the body arrives (408), and text no route can take (400: a lone surrogate).

A plain ASGI middleware rather than a FastAPI dependency: an unauthenticated or oversized
request must be turned away before its body is buffered and parsed. The body is read here,
with the size counted as it arrives (a chunked upload has no Content-Length), and replayed
to the app; after it, the app's ``receive`` still reports the client's disconnect.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import time
from collections.abc import Callable

from starlette.types import Scope

from .errors import AUTHENTICATION, APIError, answer_as_tei, in_tei_form

# A UTF-16 surrogate (U+D800-U+DFFF) as JSON's escape (a pair makes one character, a lone one a
# string that UTF-8 cannot encode: no tokenizer takes it, no answer quoting it can be sent), or
# as the bytes UTF-8 would give it, which Python's JSON parser lets through ("surrogatepass").
# Two patterns, each behind a substring test: one alternation scanned a 106 KB body byte by byte
# (1.1 ms, holding the GIL) where these take 0.12 ms.
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_RAW_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")

# The slowest a request body may arrive on average, after its first --body-timeout seconds:
# 128 kbit/s, a poor mobile link. A 32 MiB body (--max-body-bytes' default) may take 34 min.
MIN_BODY_RATE = 16 << 10  # bytes per second

# Open without a key: probes, scrapers and the API docs.
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/docs", "/docs/oauth2-redirect", "/openapi.json"})


def is_public(path: str) -> bool:
    """Whether ``path`` is open without the key: ``PUBLIC_PATHS``, and each model's readiness
    probe (``/v2/models/NAME/ready``)."""
    return path in PUBLIC_PATHS or (path.startswith("/v2/models/") and path.endswith("/ready"))


class GuardMiddleware:
    """ASGI middleware in front of every route: the API key, the body-size bound (from
    Content-Length and while reading), the body's pace (``body_timeout_s``) and lone surrogates
    in JSON strings, each refused with an OpenAI-style error (``on_error`` counts it) before a
    route or the engine sees the request."""

    def __init__(
        self,
        app,
        *,
        api_key: str | None,
        max_body_bytes: int,
        body_timeout_s: float,
        on_error: Callable[[APIError], None],
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.on_error = on_error

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = self._refused_by_headers(scope)
        if refused is not None:
            await self._reject(refused, scope, receive, send)
            return
        chunks, size = [], 0
        started = time.monotonic()
        while True:
            # No wait for the next part longer than body_timeout_s, and the whole body at
            # MIN_BODY_RATE after the first body_timeout_s: a client sending a byte a second
            # is turned away, one on a slow link sending a large body is not.
            late = started + self.body_timeout_s + size / MIN_BODY_RATE - time.monotonic()
            try:
                async with asyncio.timeout(min(self.body_timeout_s, late)):
                    message = await receive()
            except TimeoutError:
                await self._reject(self._too_slow(), scope, receive, send)
                return
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
        body = b"".join(chunks)
        err = lone_surrogate(body, scope)
        if err is not None:
            await self._reject(err, scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    def _refused_by_headers(self, scope) -> APIError | None:
        """What the request's headers alone refuse it for: a missing or wrong API key (not on
        the public routes), or a declared body over ``max_body_bytes``."""
        headers = dict(scope["headers"])  # lower-case byte names, as ASGI guarantees
        if self.api_key is not None and not is_public(scope["path"]):
            err = self._check_key(headers.get(b"authorization"))
            if err is not None:
                return err
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return self._too_large()
        return None

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

    def _too_slow(self) -> APIError:
        return APIError(
            408,
            f"the request body did not arrive in time: at most {self.body_timeout_s:g} s "
            f"(--body-timeout) between its parts, and all of it within that plus 1 s per "
            f"{MIN_BODY_RATE >> 10} KiB",
            code="request_timeout",
            headers={"Connection": "close"},  # the rest of the body is not read
        )

    async def _reject(self, err: APIError, scope, receive, send) -> None:
        self.on_error(err)
        await err.response(scope)(scope, receive, send)


def lone_surrogate(body: bytes, scope: Scope | None = None) -> APIError | None:
    """The 400 for a JSON body with a lone surrogate in any string (``"\\ud800"``), naming
    where (``input 1``, ``documents 2.text``, ``text_1``); None for any other body (a body that
    is not JSON is the route's to refuse). Bodies with no surrogate in them are not parsed.
    ``scope``: the request's, marked for TEI's error shape where the body is in TEI's form."""
    # A one-byte search first (memchr): "\\u" alone took 2 ms of a 2.4 MB body with no
    # backslash in it, holding the GIL (issue 57's /tokenize of 100,000 inputs).
    escaped = b"\\" in body and b"\\u" in body and _ESCAPED_SURROGATE.search(body) is not None
    if not escaped and not (b"\xed" in body and _RAW_SURROGATE.search(body) is not None):
        return None
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    found = _first_lone_surrogate(value)
    if found is None:
        return None  # pairs only: each a character of its own
    if scope is not None and in_tei_form(scope, value):
        answer_as_tei(scope)
    path, text, is_key = found
    where = str(path[0]) if path else ""
    where += "".join(f" {p}" if isinstance(p, int) else f".{p}" for p in path[1:])
    if is_key:
        where = f"a field name in {where}" if where else "a field name"
    position = next(i for i, ch in enumerate(text) if 0xD800 <= ord(ch) <= 0xDFFF)
    code = ord(text[position])
    return APIError(
        400,
        f"{where} is not valid Unicode: character {position} is U+{code:04X}, a lone surrogate "
        "(half of a UTF-16 pair); send the text as valid UTF-8",
        param=str(path[0]) if path else None,
        code="invalid_value",
    )


def _first_lone_surrogate(value: object) -> tuple[list[str | int], str, bool] | None:
    """(path, string, whether it is an object key) of the first string in document order that
    UTF-8 cannot encode; walked with a stack, as JSON may nest deeper than Python recurses."""
    stack: list[tuple[list[str | int], object]] = [([], value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and not _encodes(item):
                return path, item, False
        elif isinstance(item, dict):
            for key in item:
                if not _encodes(key):
                    return path, key, True
            stack.extend(([*path, k], v) for k, v in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend(([*path, i], v) for i, v in reversed(list(enumerate(item))))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # blocks until the client disconnects (or the response ends)

    return replay
