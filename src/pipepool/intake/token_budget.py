"""A call's token budget: the most tokens all its inputs may have together, and one input
alone, counted on the token slices the engine prepares anyway (``InputPreparer.token_slices``),
so a limit costs no tokenising of its own.

A server holds every request to its ``--max-tokens-per-request`` this way
(``server.limits``): the engine's submit takes the budget, and the errors here name the
counts, which the server words as its 400s.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidInputError, PromptTooLongError
from .inputs import TokenSlice


class TokenBudgetError(InvalidInputError):
    """A call's inputs have more tokens together than its budget allows. ``counted``: tokens
    counted when counting stopped; ``limit``: the budget; ``complete``: the inputs counted,
    where counting stopped before the last (None: all were)."""

    def __init__(self, counted: int, limit: int, complete: int | None = None) -> None:
        has = f"{counted} tokens" + (f" in its first {complete} inputs" if complete else "")
        super().__init__(
            f"the call has {has}; its budget is {limit} tokens per call", param="input"
        )
        self.counted, self.limit, self.complete = counted, limit, complete

    def __reduce__(self):
        return (type(self), (self.counted, self.limit, self.complete))


class InputOverBudgetError(PromptTooLongError):
    """One input has more tokens than the budget allows one input (``index``: which,
    ``tokens``: its count, ``limit``: the most)."""

    def __init__(self, index: int, tokens: int, limit: int) -> None:
        super().__init__(
            f"input {index} has {tokens} tokens; the budget takes at most {limit} tokens of "
            "one input",
            param="input",
            index=index,
        )
        self.tokens, self.limit = tokens, limit

    def __reduce__(self):
        return (type(self), (self.index, self.tokens, self.limit))


@dataclass(frozen=True)
class TokenBudget:
    """The most tokens a call may have: ``per_call``, all its inputs together (after
    truncation); ``per_input``, one input (None: no bound but the engine's own). A call over
    either is refused before anything of it is enqueued (``counted``)."""

    per_call: int
    per_input: int | None = None

    def counted(
        self, parts: Iterator[TokenSlice], inputs: int, each: int | None
    ) -> Iterator[TokenSlice]:
        """``parts`` (the slices of a call of ``inputs`` inputs, each at most ``each`` tokens
        after the engine's truncation or refusal; None: unbounded, as chunked inputs are), held
        to the budget: passed on as they come where the bound alone keeps the call within it,
        else counted in full first, so that a call over it is refused before any slice of it
        is enqueued. Raises ``InputOverBudgetError`` / ``TokenBudgetError`` at the first slice
        over it, naming the counts."""
        if self.bounds(inputs, each):
            yield from parts  # within the budget whatever the inputs' lengths
            return
        held, total = [], 0
        for part in parts:
            total = self._check(part, total, inputs)
            held.append(part)
        yield from held

    def bounds(self, inputs: int, each: int | None) -> bool:
        """Whether ``inputs`` inputs of at most ``each`` tokens (None: unbounded) are within
        the budget whatever their lengths."""
        if each is None or inputs * each > self.per_call:
            return False
        return self.per_input is None or each <= self.per_input

    def _check(self, part: TokenSlice, counted_before: int, inputs: int) -> int:
        """The tokens counted so far, with ``part``'s; raises where ``part`` passes a bound."""
        lengths = part.lengths
        if self.per_input is not None:
            over = np.flatnonzero(lengths > self.per_input)
            if len(over):
                i = int(over[0])
                raise InputOverBudgetError(part.first + i, int(lengths[i]), self.per_input)
        total = counted_before + int(lengths.sum())
        if total > self.per_call:
            counted = part.first + len(lengths)
            raise TokenBudgetError(total, self.per_call, counted if counted < inputs else None)
        return total
