"""The flags of remote images (``server/media_fetch.py``), shared by ``pipepool serve`` and
``pipepool run-batch``: which hosts' image URLs are fetched, and within what."""

from __future__ import annotations

import argparse

from ..server.settings import ServerSettings
from .common import add_env_argument

_DEFAULTS = ServerSettings()


def add_media_args(group) -> None:
    """``--allowed-media-domains``, ``--media-fetch-timeout``, ``--media-fetch-max-bytes``."""
    add_env_argument(
        group,
        "--allowed-media-domains",
        type=_domains,
        default=_DEFAULTS.allowed_media_domains,
        help="vLLM's: hosts whose http(s) image URLs are fetched, comma-separated (default: "
        "none; every remote URL is refused, data URIs and --allowed-local-media-path files "
        "only). Redirects are not followed",
    )
    add_env_argument(
        group,
        "--media-fetch-timeout",
        type=float,
        default=_DEFAULTS.media_fetch_timeout_s,
        help="seconds a remote image may take to fetch, connecting included; slower ones are "
        "answered 400 naming the input (default 5, vLLM's)",
    )
    add_env_argument(
        group,
        "--media-fetch-max-bytes",
        type=int,
        default=_DEFAULTS.media_fetch_max_bytes,
        help="bytes a remote image may have; larger ones are refused, reading stops there "
        "(default 20 MiB)",
    )


def media_settings(args: argparse.Namespace) -> dict:
    """The ``ServerSettings`` fields of the flags ``add_media_args`` added."""
    return {
        "allowed_media_domains": args.allowed_media_domains,
        "media_fetch_timeout_s": args.media_fetch_timeout,
        "media_fetch_max_bytes": args.media_fetch_max_bytes,
    }


def _domains(value: str) -> tuple[str, ...]:
    """Host names, comma-separated, as URLs spell them (lower case)."""
    return tuple(d.strip().lower() for d in value.split(",") if d.strip())
