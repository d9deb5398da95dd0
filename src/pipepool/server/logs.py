"""One log format for the whole server process — uvicorn's loggers and pipepool's — with
timestamps: ``text`` for people, ``json`` (one object per line) for log collectors."""

from __future__ import annotations

import json
import logging
import time

TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per log record (time, level, logger, message and the record's extra
    fields), for ``--log-format json``."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        http = getattr(record, "http", None)  # an access line's fields (metrics.py)
        if isinstance(http, dict):
            entry.update(http)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def log_config(level: str, fmt: str) -> dict:
    """A ``logging.config.dictConfig`` dict, given to uvicorn (which applies it at start)."""
    formatter = (
        {"()": JsonFormatter}
        if fmt == "json"
        else {"format": TEXT_FORMAT, "datefmt": "%Y-%m-%d %H:%M:%S"}
    )
    handler = {"class": "logging.StreamHandler", "formatter": "main", "stream": "ext://sys.stderr"}
    level = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"main": formatter},
        "handlers": {"main": handler},
        "root": {"handlers": ["main"], "level": level},
        "loggers": {
            # propagate to the root's one handler: one format, no line twice
            name: {"handlers": [], "level": level, "propagate": True}
            for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "pipepool")
        },
    }
