"""Image inputs over HTTP (Cohere's ``/v2/embed`` ``images``, vLLM's ``image_url`` parts):
data URIs, ``file://`` URIs under ``--allowed-local-media-path``, and http(s) URLs of the hosts
``--allowed-media-domains`` names (``media_fetch.py``; any other is a 400 naming the input);
the bytes go to ``Engine.submit``, which refuses bad
or oversized images by index before decoding (``intake/images.py``), decoding and resizing
on a tokenising lane, off the event loop."""

from __future__ import annotations

import base64
import binascii
import io
import re
from pathlib import Path

from fastapi import Request, Response

from ...intake.conversation import RemoteImage
from ..errors import APIError
from ..front import INLINE_SIZE, Encoded, EngineCall
from ..limits import check_input_count
from ..models import ServedModel
from ..settings import ServerSettings
from .shared import check_task, model_of, run_engine, state_of

# Cohere's image formats (its /v2/embed document: jpeg, png, webp, gif).
MEDIA_TYPES = ("image/jpeg", "image/png", "image/webp", "image/gif")


def data_uri_bytes(uris: list[str], param: str) -> list[bytes | Path | RemoteImage]:
    """Each URI's image (``image_from_uri``), 400 naming ``param[i]`` for a bad one."""
    return [image_from_uri(uri, f"{param}[{i}]", param) for i, uri in enumerate(uris)]


def image_from_uri(uri: str, name: str, param: str) -> bytes | Path | RemoteImage:
    """A ``data:image/...;base64,...`` URI's bytes, a ``file://`` URI's path (the engine
    reads it only under ``--allowed-local-media-path``, as vLLM does), or an http(s) URL to
    fetch (``media_fetch.py``: from the hosts ``--allowed-media-domains`` names only); 400
    (field ``param``) naming ``name`` for any other form."""
    if uri.startswith("file://"):
        return Path(uri.removeprefix("file://"))
    if uri.startswith(("http://", "https://")):
        return RemoteImage(uri, name)  # fetched or refused by its host (media_fetch.py)
    head, comma, payload = uri.partition(",")
    media = head.removeprefix("data:").removesuffix(";base64")
    if not head.startswith("data:") or not comma or not head.endswith(";base64"):
        raise APIError(
            400, f"{name} is not a base64 data URI (data:image/png;base64,...)",
            param=param, code="invalid_value",
        )  # fmt: skip
    if media not in MEDIA_TYPES:
        raise APIError(
            400, f"{name} has media type {media!r}; one of {', '.join(MEDIA_TYPES)}",
            param=param, code="invalid_value",
        )  # fmt: skip
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(
            400, f"{name}: its base64 payload does not decode", param=param,
            code="invalid_value",
        ) from None  # fmt: skip


def image_meta(blob: bytes | Path) -> dict:
    """Cohere's ``Image`` of an image the engine embedded: size, format, bits per channel
    (from its header)."""
    from PIL import Image

    with Image.open(io.BytesIO(blob) if isinstance(blob, bytes) else blob) as image:
        bits = 16 if image.mode.startswith("I;16") else 1 if image.mode == "1" else 8
        return {
            "width": image.width,
            "height": image.height,
            "format": (image.format or "").lower(),
            "bit_depth": bits,
        }


async def run_model_images(
    request: Request,
    blobs: list[bytes | Path],
    param: str,
    names: list[str] | None = None,
    **options,
) -> Encoded | Response:
    """``images_call`` of the request's model, run (``run_engine``); a bare Response (499) if
    the client left meanwhile."""
    work = images_call(state_of(request).settings, model_of(request), blobs, param, names, options)
    return await run_engine(request, work)


def images_call(
    settings: ServerSettings,
    model: ServedModel,
    blobs: list[bytes | Path],
    param: str,
    names: list[str] | None,
    options: dict,
) -> EngineCall:
    """``Engine.submit(blobs, **options)`` as an engine call (decoding is CPU work: always on a
    lane), its refusals a 400 (field ``param``) naming each image as ``names[i]`` (default
    ``param[i]``). 404 for a model that does not embed."""
    check_task(model, "embed")
    check_input_count(settings, len(blobs), param)
    # The front end weighs a request by what it holds to pick where it runs; an image is
    # weighed as at least more than the event loop does itself, so that it is always decoded
    # on a lane (a file:// path would otherwise weigh one).
    weights = [range(max(len(b) if isinstance(b, bytes) else 0, INLINE_SIZE + 1)) for b in blobs]
    return EngineCall(
        weights,
        submit=lambda engine: engine.submit(blobs, **options),
        renamed=lambda exc: renamed(exc, param, names),
    )


def renamed(exc: APIError, param: str, names: list[str] | None = None) -> APIError:
    """The engine's refusal of ``input i`` (field ``input``) as this route's: field ``param``,
    the input named ``names[i]`` (default ``param[i]``); any other error as it is."""
    if exc.param != "input":
        return exc

    def name(found: re.Match) -> str:
        i = int(found[1])
        return f"{names[i] if names is not None and i < len(names) else f'{param}[{i}]'}:"

    message = re.sub(r"^input (\d+):", name, exc.message)
    return APIError(exc.status, message, param=param, code=exc.code)
