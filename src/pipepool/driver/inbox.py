"""What callers put in a ``LocalPipeline``'s inbox; its loop thread applies them in order."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from ..core.request import RequestBatch
from ..core.submission import Submission


@dataclass(frozen=True)
class AddBatch:
    """Schedule these prompts."""

    batch: RequestBatch


@dataclass(frozen=True)
class AbortCall:
    """A cancelled call: drop whatever of its batches is unfinished."""

    submission: Submission


@dataclass(frozen=True)
class GatherTrace:
    """Answer with every process's spans once no plan is in flight."""

    future: Future


InboxMessage = AddBatch | AbortCall | GatherTrace
