"""A request's wait for its work (``server/awaiting.py``): given up on when its client leaves
or the server abandons it, its work cancelled where it waits; anything else goes through."""

from __future__ import annotations

import asyncio

import pytest

from pipepool.server.awaiting import Awaiting, GivenUp


class Connection:
    """A request's ``receive``: nothing until ``leave()``, then the disconnect."""

    def __init__(self) -> None:
        self._left = asyncio.Event()

    def leave(self) -> None:
        self._left.set()

    async def receive(self) -> dict:
        await self._left.wait()
        return {"type": "http.disconnect"}


async def _work(started: asyncio.Event, seen: list[str], result: object = "done") -> object:
    """Work that waits until cancelled (or, with ``result`` set, returns it once let go)."""
    started.set()
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        seen.append("cancelled")  # where an engine call aborts its requests
        raise
    return result


async def _waiting(awaiting: Awaiting) -> tuple[asyncio.Task, list[str]]:
    """A request's task waiting on ``awaiting`` for work that has started, and what the work
    saw."""
    started, seen = asyncio.Event(), []
    task = asyncio.ensure_future(awaiting.result(_work(started, seen), Connection().receive))
    await started.wait()
    return task, seen


def test_the_work_s_result_and_errors_come_back_as_they_are():
    async def main() -> None:
        awaiting = Awaiting()

        async def fails() -> None:
            raise ValueError("the engine refused it")

        assert await awaiting.result(asyncio.sleep(0, result=7), Connection().receive) == 7
        with pytest.raises(ValueError, match="refused"):
            await awaiting.result(fails(), Connection().receive)
        await asyncio.sleep(0)  # the watches cancelled: only this task is left
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())


def test_a_client_that_leaves_cancels_its_work_and_its_task_goes_on():
    async def main() -> None:
        awaiting, conn, started, seen = Awaiting(), Connection(), asyncio.Event(), []

        async def route() -> str:
            try:
                await awaiting.result(_work(started, seen), conn.receive)
            except GivenUp as gone:
                assert not gone.abandoned
                await asyncio.sleep(0)  # not cancelled again: the route answers its 499
                return "client left"
            return "answered"

        task = asyncio.ensure_future(route())
        await started.wait()
        conn.leave()
        assert await task == "client left"
        assert seen == ["cancelled"]

    asyncio.run(main())


def test_abandon_gives_up_on_the_waiting_and_on_later_requests():
    async def main() -> None:
        awaiting = Awaiting()
        task, seen = await _waiting(awaiting)
        awaiting.abandon()
        with pytest.raises(GivenUp) as gone:
            await task
        assert gone.value.abandoned and seen == ["cancelled"]
        later = _work(asyncio.Event(), seen)
        with pytest.raises(GivenUp) as gone:
            await awaiting.result(later, Connection().receive)
        assert gone.value.abandoned
        assert later.cr_frame is None  # closed, never started ("never awaited": no warning)

    asyncio.run(main())


def test_a_cancellation_from_outside_goes_through():
    async def main() -> None:
        awaiting = Awaiting()
        task, seen = await _waiting(awaiting)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seen == ["cancelled"]
        awaiting.abandon()  # nothing left waiting

    asyncio.run(main())


def test_a_client_leaving_as_the_work_ends_is_given_up_on_once():
    """The disconnect arrives in the loop turn where the work's result does: the request is
    given up on (nobody reads its answer), and its task is left uncancelled."""

    async def main() -> None:
        awaiting, conn, seen = Awaiting(), Connection(), []
        done = asyncio.get_running_loop().create_future()

        async def work() -> str:
            try:
                return await done
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise

        async def route() -> tuple[str, int]:
            try:
                outcome = await awaiting.result(work(), conn.receive)
            except GivenUp:
                outcome = "client left"
            await asyncio.sleep(0)  # the answer's own awaits are not cancelled
            return outcome, asyncio.current_task().cancelling()

        task = asyncio.ensure_future(route())
        await asyncio.sleep(0)
        done.set_result("answered")
        conn.leave()
        outcome, cancelling = await task
        assert outcome in ("answered", "client left") and cancelling == 0

    asyncio.run(main())
