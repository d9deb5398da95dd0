"""Which models ``pipepool serve`` serves: ``--model [NAME=]PATH`` (repeatable) and
``--models-file FILE.toml`` for options per model.

The file holds one table per model, its key the name clients send::

    [models.embedder]
    model = "/srv/models/bge-small-en-v1.5"   # folder or hub id (required)
    aliases = ["bge-small"]                   # more names clients may send
    tasks = ["embed"]                         # offer it for these only (api.routing.TASKS)
    max_queued_requests = 4096                # its own queue (429 past it)
    dtype = "float16"                         # any engine option, by its EngineConfig name
    data_parallel_size = 2

The engine flags on the command line apply to every model; a model's table overrides them for
that model. Anything else in a table is refused by name.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..config import EngineConfig
from ..errors import InvalidInputError
from .common import engine_config

# What a model's table may hold besides EngineConfig options.
_SERVER_KEYS = {"model", "aliases", "tasks", "max_queued_requests"}


@dataclass(frozen=True)
class ModelSpec:
    """One model to serve: the names clients may send for it (the first is what responses
    carry), the engine config it runs with, the tasks it is offered for (None: all it can
    do) and its queue's limit."""

    names: tuple[str, ...]
    config: EngineConfig
    tasks: tuple[str, ...] | None
    max_queued_requests: int

    @property
    def name(self) -> str:
        return self.names[0]


def model_specs(args: argparse.Namespace) -> list[ModelSpec]:
    """The models the command line asks for, checked (each config, no name served twice):
    the ``--model`` flags in order, then the file's tables in order; the bundled model when
    neither names one."""
    from ..server.models import served_model_names

    queued = args.max_queued_requests
    given = args.model or _env_model()
    if args.served_model_name and len(given) + bool(args.models_file) > 1:
        raise InvalidInputError(
            "--served-model-name names the one model served; with several, name each as "
            "--model NAME=PATH (or in --models-file)",
            param="served_model_name",
        )
    specs = []
    for text in given:
        name, path = _name_and_path(text)
        names = (name,) if name else served_model_names(path, args.served_model_name)
        specs.append(ModelSpec(names, engine_config(args, model=path), None, queued))
    if args.models_file:
        specs += _from_file(Path(args.models_file), args)
    if not specs:
        names = served_model_names(None, args.served_model_name)
        specs.append(ModelSpec(names, engine_config(args), None, queued))
    return specs


def _env_model() -> list[str]:
    """``PIPEPOOL_MODEL``: the model to serve when no --model is given."""
    text = os.environ.get("PIPEPOOL_MODEL")
    if text is None:
        return []
    if not text.strip():
        raise InvalidInputError(
            "PIPEPOOL_MODEL is set but empty: expected [NAME=]PATH (or unset it)", param="model"
        )
    return [text.strip()]


def _name_and_path(text: str) -> tuple[str | None, str]:
    """``NAME=PATH`` or ``PATH`` (a path with "=" in it is taken whole where what comes
    before the "=" holds a "/")."""
    name, sep, path = text.partition("=")
    if not sep or "/" in name:
        return None, text
    if not name or not path:
        raise InvalidInputError(f"--model {text!r}: expected NAME=PATH or PATH", param="model")
    return name, path


def _from_file(path: Path, args: argparse.Namespace) -> list[ModelSpec]:
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise InvalidInputError(
            f"--models-file {path}: {exc.strerror}", param="models_file"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidInputError(f"--models-file {path}: {exc}", param="models_file") from None
    extra = set(data) - {"models"}
    tables = data.get("models")
    if extra or not isinstance(tables, dict) or not tables:
        raise InvalidInputError(
            f"--models-file {path}: expected [models.NAME] tables only"
            + (f" (found {', '.join(sorted(extra))})" if extra else ""),
            param="models_file",
        )
    options = {f.name for f in fields(EngineConfig) if f.metadata.get("cli")} - {"model"}
    specs = []
    for name, table in tables.items():
        where = f"--models-file {path}, model {name!r}"
        if not isinstance(table, dict):
            raise InvalidInputError(f"{where}: expected a table", param="models_file")
        unknown = set(table) - options - _SERVER_KEYS
        if unknown:
            raise InvalidInputError(
                f"{where}: unknown option(s) {', '.join(sorted(unknown))}; a model takes "
                f"{', '.join(sorted(_SERVER_KEYS))} and engine options by name "
                "(dtype, pipeline_parallel_size, data_parallel_size, max_model_len, ...)",
                param="models_file",
            )
        if not isinstance(table.get("model"), str):
            raise InvalidInputError(f'{where}: needs model = "PATH"', param="models_file")
        names = (name, *_strings(table, "aliases", where))
        tasks = _strings(table, "tasks", where) if "tasks" in table else None
        queued = table.get("max_queued_requests", args.max_queued_requests)
        overrides: dict[str, Any] = {k: v for k, v in table.items() if k in options}
        try:
            config = engine_config(args, model=table["model"], **overrides)
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(f"{where}: {exc}", param="models_file") from None
        specs.append(ModelSpec(names, config, tasks, queued))
    return specs


def _strings(table: dict, key: str, where: str) -> tuple[str, ...]:
    value = table.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise InvalidInputError(f"{where}: {key} must be a list of names", param="models_file")
    return tuple(value)
