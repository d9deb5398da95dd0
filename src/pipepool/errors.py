"""Exceptions a caller of pipepool may catch.

Input problems are ``ValueError`` subclasses so that generic callers handle them as they would
any bad argument; engine failures are ``RuntimeError`` subclasses.
"""

from __future__ import annotations


class PipepoolError(Exception):
    """Base class of every error pipepool raises on purpose."""


class InvalidInputError(PipepoolError, ValueError):
    """A request was rejected before it reached the scheduler. ``param`` names the field;
    ``index``, when one input is to blame, its position in the call (so the CLI can name the
    line of a file it came from)."""

    def __init__(self, message: str, *, param: str | None = None, index: int | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.index = index

    def __reduce__(self):  # keep ``param`` and ``index`` across a process boundary
        return (type(self), (str(self),), {"param": self.param, "index": self.index})


class PromptTooLongError(InvalidInputError):
    """A prompt is longer than ``max_model_len`` (or the KV cache); truncation was not asked for."""


class ModelLoadError(PipepoolError, ValueError):
    """A model folder cannot be loaded: unknown architecture, missing or unexpected weights."""


class EngineDeadError(PipepoolError, RuntimeError):
    """The engine stopped (closed, or a stage failed); no request can be served any more."""


class StageFailure(EngineDeadError):
    """A pipeline stage raised or its process died. ``stage`` is the stage index (0-based)."""

    def __init__(self, message: str, *, stage: int | None = None) -> None:
        super().__init__(message)
        self.stage = stage

    def __reduce__(self):  # keep ``stage`` when the error crosses a process boundary
        return (type(self), (str(self),), {"stage": self.stage})


class StateDivergence(StageFailure):
    """A stage's per-request state disagrees with the step plan or with another stage.

    This is the failure docs/design.md §1 exists to make impossible: rather than return vectors
    computed from drifted positions or KV slots, the engine stops and names the culprit.
    """

    def __init__(
        self,
        *,
        step_id: int,
        stage: int,
        request_id: int,
        expected: int,
        found: int,
        what: str = "num_computed_tokens",
        check: str = "",
        found_by: str = "",
    ) -> None:
        self.step_id = step_id
        self.request_id = request_id
        self.expected = expected
        self.found = found
        # Which check caught it: "mirror" (a stage's mirror against the plan, before it
        # computes), "neighbour" (a stage checking the digest it received), "driver" (the
        # scheduler checking the last stage's digest chain); and where it ran.
        self.check = check
        self.found_by = found_by
        who = f" (found by {found_by}, {check} check)" if check else ""
        request = f", request {request_id}" if request_id >= 0 else ""
        super().__init__(
            f"state divergence at step {step_id}, stage {stage}{request}: "
            f"{what} expected {expected}, found {found}{who}",
            stage=stage,
        )

    def __reduce__(self):  # exceptions with keyword-only args need this to cross processes
        fields = (self.step_id, self.stage, self.request_id, self.expected, self.found)
        return (_rebuild_divergence, (*fields, self.check, self.found_by, str(self)))


def _rebuild_divergence(
    step_id: int, stage: int, request_id: int, expected: int, found: int, check: str,
    found_by: str, message: str,
) -> StateDivergence:  # fmt: skip
    err = StateDivergence(
        step_id=step_id, stage=stage, request_id=request_id, expected=expected, found=found,
        check=check, found_by=found_by,
    )  # fmt: skip
    err.args = (message,)
    return err
