"""What one row of a corpus is: where it comes from (``CorpusSpec``), the (row, id, text) it
gives or the ``RowError`` it is, and the kinds of id a corpus may have."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

# Where a corpus's ids come from: "row", its row numbers (a .txt file, or no id field); else
# its id field, all integers ("int64") or all strings ("string").
IdKind = Literal["row", "int64", "string"]
_INT64 = (-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class CorpusSpec:
    """What to read: ``path``, whose suffix is its format (``corpus_input.FORMATS``), and
    the fields of a .jsonl object or .parquet row that hold the id and the text. A .txt line
    is a text, its id its row number; the fields do not apply."""

    path: Path
    id_field: str = "id"
    text_field: str = "text"

    @property
    def format(self) -> str:
        return self.path.suffix.lower().removeprefix(".")


@dataclass(frozen=True)
class RowError:
    """A row that gives no vector: ``row`` (1-based), its id when it has a valid one, why."""

    row: int
    id: int | str | None
    error: str

    def as_json(self) -> dict[str, Any]:
        return {"row": self.row, "id": self.id, "error": self.error}


# One row as read: (row, id, text), or why it gives no vector.
Entry = tuple[int, int | str, str] | RowError


def id_kind_of(value: object) -> IdKind | None:
    """The kind of id ``value`` can be, or None (a bool, a float, an int outside int64)."""
    if isinstance(value, str):
        return "string"
    if isinstance(value, int) and not isinstance(value, bool) and _INT64[0] <= value <= _INT64[1]:
        return "int64"
    return None
