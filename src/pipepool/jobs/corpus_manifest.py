"""A corpus job's ``manifest.json``: every setting its vectors depend on, written before the
first shard, and once the job is done, what it wrote.

A rerun compares its own settings with the manifest's and goes on only where they are equal,
so an output folder never holds vectors made two ways; ``SettingsMismatchError`` names each
difference.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidInputError
from .corpus_files import atomic_write

NAME = "manifest.json"
FORMAT = 1  # the manifest's own layout; a manifest of another is refused, not guessed at
# Bytes read from each end of a file for its fingerprint: cheap on a 100 GB corpus, and an
# edit, an append or a truncation changes the size or an end.
_FINGERPRINT_BYTES = 1 << 20


@dataclass(frozen=True)
class Manifest:
    """``settings``: name -> JSON value, each one the vectors depend on (what a rerun
    compares). ``input``: the corpus's path when the job began, for people (not compared: a
    moved corpus is the same corpus). ``completed``: None while the job runs; then what it
    wrote (shards, rows, vectors, errors)."""

    settings: dict[str, Any]
    input: str
    completed: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        assert self.settings == _as_json(self.settings), "settings must be JSON values"


class SettingsMismatchError(InvalidInputError):
    """An output folder's manifest was written with other settings; ``differences`` names
    each differing setting (by its label)."""

    def __init__(self, message: str, *, differences: list[str]) -> None:
        super().__init__(message, param="output_dir")
        self.differences = differences


def manifest_path(folder: Path) -> Path:
    return folder / NAME


def load(folder: Path) -> Manifest | None:
    """The folder's manifest, or None where there is none."""
    path = manifest_path(folder)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"cannot read {path}: {exc}", param="output_dir") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise InvalidInputError(
            f"{path} is not a manifest this pipepool writes (format {FORMAT}); give another "
            "--output-dir",
            param="output_dir",
        )
    return Manifest(data["settings"], data["input"], data.get("completed"))


def save(folder: Path, manifest: Manifest) -> None:
    """Write the manifest whole (``atomic_write``)."""
    data = {
        "format": FORMAT,
        "input": manifest.input,
        "settings": manifest.settings,
        "completed": manifest.completed,
    }
    text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    atomic_write(manifest_path(folder), lambda f: f.write(text.encode("utf-8")))


def check(
    folder: Path,
    recorded: Mapping[str, Any],
    current: Mapping[str, Any],
    labels: Mapping[str, str] | None = None,
) -> None:
    """Raise ``SettingsMismatchError`` unless every setting of ``current`` has the same value
    in ``recorded`` (the manifest's). ``labels``: how to name a setting (its flag)."""
    differences = []
    described = []
    for key, value in _as_json(dict(current)).items():
        if key in recorded and recorded[key] == value:
            continue
        label = (labels or {}).get(key, key)
        differences.append(label)
        there = json.dumps(recorded[key]) if key in recorded else "absent"
        described.append(f"{label}: {there} there, {json.dumps(value)} now")
    if differences:
        raise SettingsMismatchError(
            f"{manifest_path(folder)} was written with other settings, and vectors made two ways "
            f"must not mix: {'; '.join(described)}. Rerun with the manifest's settings to "
            "resume, or give another --output-dir",
            differences=differences,
        )


def file_fingerprint(path: Path) -> str:
    """A cheap content fingerprint: the size and a hash of both ends of the file."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(_FINGERPRINT_BYTES))
        if size > _FINGERPRINT_BYTES:
            f.seek(max(size - _FINGERPRINT_BYTES, _FINGERPRINT_BYTES))
            digest.update(f.read())
    return digest.hexdigest()[:32]


def folder_fingerprint(folder: Path) -> str:
    """``file_fingerprint`` of every file under ``folder`` (a model's weights, config and
    tokenizer), with their relative names, in one hash."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = path.relative_to(folder).as_posix()
        if relative.startswith(".") or "/." in relative:
            continue  # hidden files (a hub cache's .no_exist, editors' swap files)
        digest.update(f"{relative}\0{file_fingerprint(path)}\0".encode())
    return digest.hexdigest()[:32]


def _as_json(value: dict[str, Any]) -> dict[str, Any]:
    """``value`` as a manifest reads it back (tuples become lists, ...)."""
    return json.loads(json.dumps(value))
