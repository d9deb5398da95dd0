"""How many uploads one front-end process receives at once (``--max-concurrent-uploads``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from .errors import RATE_LIMIT, APIError, retry_later_headers
from .settings import ServerSettings

__all__ = ["UploadSlots", "upload_slot"]


class UploadSlots:
    """At most ``limit`` uploads at once. One more waits ``wait_s`` for a slot, then is
    refused 429 (Retry-After) without its body being read: each upload holds a file open and
    a disk busy, and the uploads past the cap would only queue for the same disk."""

    def __init__(self, limit: int, wait_s: float) -> None:
        assert limit >= 1, limit
        self.limit, self.wait_s = limit, wait_s
        self._free = asyncio.Semaphore(limit)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        try:
            async with asyncio.timeout(self.wait_s):
                await self._free.acquire()
        except TimeoutError:
            raise APIError(
                429,
                f"{self.limit} uploads are being received (--max-concurrent-uploads); retry "
                "after the Retry-After header's seconds",
                type=RATE_LIMIT,
                code="too_many_uploads",
                headers={**retry_later_headers(), "Connection": "close"},  # body left unread
            ) from None
        try:
            yield
        finally:
            self._free.release()


def upload_slot(app: Any, settings: ServerSettings) -> contextlib.AbstractAsyncContextManager:
    """A slot of the app's ``UploadSlots`` (made on first use, in the app's event loop)."""
    slots = getattr(app.state, "upload_slots", None)
    if slots is None:
        slots = app.state.upload_slots = UploadSlots(
            settings.max_concurrent_uploads, settings.queue_wait_s
        )
    return slots.slot()
