"""Remote images: an http(s) image URL is fetched only from a host ``--allowed-media-domains``
names (vLLM's flag; none by default), within ``--media-fetch-timeout`` seconds (connecting
included) and ``--media-fetch-max-bytes`` bytes (reading stops there), with no redirect
followed: a URL must not turn the server into a proxy into its own network, nor hold a request
or its memory. Every refusal is a 400 naming the input. Fetching is asynchronous, on the event
loop (it waits on the network, it computes nothing); the bytes then go where a data URI's go."""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from fastapi import Request

from ..intake.conversation import RemoteImage
from .errors import APIError
from .routes.shared import state_of
from .settings import ServerSettings

_CHUNK = 64 << 10


async def fetched(
    request: Request, images: list[bytes | Path | RemoteImage], param: str
) -> list[bytes | Path]:
    """``images`` with each remote one's bytes in its place, fetched concurrently; 400 (field
    ``param``) naming the first refused."""
    settings = state_of(request).settings
    remote = [(i, image) for i, image in enumerate(images) if isinstance(image, RemoteImage)]
    if not remote:
        return images  # type: ignore[return-value]  # no RemoteImage in it
    for _, image in remote:
        _check_host(image, settings, param)
    async with httpx.AsyncClient(follow_redirects=False, trust_env=False) as client:
        blobs = await asyncio.gather(
            *(_fetch(client, image, settings, param) for _, image in remote)
        )
    out = list(images)
    for (i, _), blob in zip(remote, blobs, strict=True):
        out[i] = blob
    return out  # type: ignore[return-value]  # every RemoteImage replaced


def _check_host(image: RemoteImage, settings: ServerSettings, param: str) -> None:
    host = (urlsplit(image.url).hostname or "").lower()
    if host in settings.allowed_media_domains:
        return
    allowed = ", ".join(settings.allowed_media_domains)
    raise APIError(
        400,
        f"{image.where} is a remote URL of host {host or '(none)'!r}, which "
        f"--allowed-media-domains does not name ({allowed or 'it names none'}); send the image "
        "as a data URI (data:image/png;base64,...) or a file under --allowed-local-media-path",
        param=param,
        code="invalid_value",
    )


async def _fetch(
    client: httpx.AsyncClient, image: RemoteImage, settings: ServerSettings, param: str
) -> bytes:
    limit, seconds = settings.media_fetch_max_bytes, settings.media_fetch_timeout_s
    try:
        return await asyncio.wait_for(_read(client, image, limit, param), seconds)
    except TimeoutError:
        why = f"it took longer than {seconds:g} s (--media-fetch-timeout)"
    except httpx.HTTPError as exc:
        why = f"{type(exc).__name__}"
    raise APIError(
        400, f"{image.where} could not be fetched: {why}", param=param, code="invalid_value"
    )


async def _read(client: httpx.AsyncClient, image: RemoteImage, limit: int, param: str) -> bytes:
    async with client.stream("GET", image.url) as response:
        if response.status_code != 200:
            where = response.headers.get("location") if response.is_redirect else None
            said = f" (to {where}: redirects are not followed)" if where else ""
            raise APIError(
                400,
                f"{image.where} could not be fetched: HTTP {response.status_code}{said}",
                param=param,
                code="invalid_value",
            )
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            _too_large(image, limit, param)
        body = bytearray()
        async for chunk in response.aiter_bytes(_CHUNK):
            body += chunk
            if len(body) > limit:
                _too_large(image, limit, param)
        return bytes(body)


def _too_large(image: RemoteImage, limit: int, param: str) -> None:
    raise APIError(
        400,
        f"{image.where} is over {limit} bytes (--media-fetch-max-bytes); it was not read whole",
        param=param,
        code="invalid_value",
    )
