"""One-text requests that reach the engine in one turn of the event loop, as one engine call.

Under many one-text requests, a front end's event loop starts several of them in each of its
turns (six on average, up to twenty-odd, on the 2-core proxy at 64 in flight), and each made an
engine call of its own: a call's future, its tokenising, its queue entry, its message to a
replica and back, and a wake-up of the loop when it is done, per text. Here the requests of
one turn whose calls differ only in their text (``Joinable.key``: the same options, the same
client's turn) are submitted together at the start of the next turn, as one call of their
texts, and the loop is woken once when it is done; each request reads its own row. A call is
scheduled as its requests were: they are one client's, whose calls take one turn anyway
(``core.priority.client_turns``), and requests of other clients are never joined.

A joined call that the engine refuses (one text over the token budget, say) is made again
request by request, so that each request gets its own answer or its own error. A request that
leaves (its client hung up) gives up its row; the call is cancelled once every one of its
requests has left.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..api.engine import Engine
    from ..core.submission import Submission

# The most requests one joined call takes: a turn's texts are tokenised on the loop in one go,
# and a call of more rows gains nothing over two.
MAX_JOINED = 64


@dataclass(frozen=True)
class Joinable:
    """How a one-text request's engine call joins others: ``key`` names everything but the
    text that the call depends on; ``submit(engine, texts)`` makes the call of several such
    texts (one input each, in order)."""

    key: Hashable
    submit: Callable[[Engine, list], Submission]


class SharedCall:
    """One engine call answering several requests, row ``i`` request ``i``'s. ``wait(i)``
    waits for it (the loop is woken once for all), ``leave(i)`` gives a row up."""

    def __init__(self, submission: Submission, size: int, loop: asyncio.AbstractEventLoop) -> None:
        self.submission = submission
        self._waiters = [loop.create_future() for _ in range(size)]
        self._left = size
        submission.add_done_callback(lambda _f: self._wake(loop))

    def _wake(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the engine's thread: the loop finishes the waits."""
        with contextlib.suppress(RuntimeError):  # the loop closed (shutdown): nobody waits
            loop.call_soon_threadsafe(self._finished)

    def _finished(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self, row: int) -> tuple[Any, int]:
        """Row ``row``'s outputs (a one-row slice of the call's) and its prompt tokens; what
        the call raised, if it failed."""
        await self._waiters[row]
        outputs = self.submission.result()
        return outputs[row : row + 1], int(self.submission.num_tokens[row])

    def leave(self, row: int) -> bool:
        """Request ``row`` no longer waits; true if its row was not answered yet. The call is
        cancelled once no request waits for it."""
        unanswered = not self.submission.done()
        self._left -= 1
        if self._left == 0:
            self.submission.cancel()
        return unanswered


@dataclass
class _Waiting:
    text: Any
    alone: Callable[[Engine], Any]  # the request's own call (a Submission), as made unjoined
    context: contextvars.Context
    joined: asyncio.Future  # (SharedCall, row)


class JoinedCalls:
    """The one-text calls of an event loop's turn, joined by key (see the module's doc). Used
    from the loop's thread only."""

    def __init__(self) -> None:
        self._turn: dict[tuple[int, Hashable], tuple[Engine, Joinable, list[_Waiting]]] = {}
        self.calls = 0  # engine calls made for more than one request (metrics)
        self.requests = 0  # requests answered by such calls

    def add(
        self, engine: Engine, join: Joinable, text: Any, alone: Callable[[Engine], Any]
    ) -> asyncio.Future:
        """A future of (SharedCall, row) for ``text``'s call, made at the next turn of the
        loop; ``alone(engine)``: the request's call unjoined (made where no other joins it, or
        the joined call is refused), whose errors the future raises."""
        loop = asyncio.get_running_loop()
        if not self._turn:
            loop.call_soon(self._submit_turn)
        slot = (id(engine), join.key)
        entry = self._turn.get(slot)
        if entry is None or len(entry[2]) >= MAX_JOINED:
            if entry is not None:  # full: made now, a new one takes this text
                self._submit(*self._turn.pop(slot))
            entry = self._turn[slot] = (engine, join, [])
        joined = loop.create_future()
        entry[2].append(_Waiting(text, alone, contextvars.copy_context(), joined))
        return joined

    def _submit_turn(self) -> None:
        turn, self._turn = self._turn, {}
        for engine, join, waiting in turn.values():
            self._submit(engine, join, waiting)

    def _submit(self, engine: Engine, join: Joinable, waiting: list[_Waiting]) -> None:
        waiting = [w for w in waiting if not w.joined.cancelled()]  # their clients left
        if len(waiting) > 1:
            texts = [w.text for w in waiting]
            try:
                # In the first request's context: the client whose turn the call takes.
                submission = waiting[0].context.run(join.submit, engine, texts)
            except Exception:
                pass  # one text refused: each request gets its own answer, below
            else:
                self.calls += 1
                self.requests += len(waiting)
                self._share(submission, waiting)
                return
        for w in waiting:
            try:
                submission = w.context.run(w.alone, engine)
            except Exception as exc:
                w.joined.set_exception(exc)
            else:
                self._share(submission, [w])

    @staticmethod
    def _share(submission: Submission, waiting: list[_Waiting]) -> None:
        call = SharedCall(submission, len(waiting), asyncio.get_running_loop())
        for row, w in enumerate(waiting):
            w.joined.set_result((call, row))
