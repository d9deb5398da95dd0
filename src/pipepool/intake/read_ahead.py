"""A call's slices tokenised ahead of the thread that enqueues them.

``Engine.submit`` enqueues a call's token slices one after the other, and after each it may
wait for the engine (``driver.pacing.IntakePacer``). Tokenised on that thread, the next slice
would start only once the last was enqueued and the wait was over: the tokenizer idle while
the device computes, the device idle while the tokenizer works. Here threads of the call's own
tokenise the next slices meanwhile, a bounded number of them, so a call of any size holds a
few slices at a time. Several slices at once, not one: where the tokenizer is a pool of
processes (``tokenizer_pool``), the next slice's chunks keep its processes busy while the
last chunks of a slice finish.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

# Slices tokenised or being tokenised and not yet taken, at most: two keep the tokenizer busy
# through a wait of the enqueueing thread of a slice's tokenising; more only hold memory.
AHEAD = 2


def read_ahead(tasks: Iterable[Callable[[], T]], ahead: int = AHEAD) -> Iterator[T]:
    """The results of ``tasks``, in order, each computed on a thread of the call's own, at
    most ``ahead`` of them started and not yet taken. A task's exception is raised here when
    its result would have been taken. Closing this iterator (or dropping it) starts no more
    tasks; those running finish, their results dropped."""
    pending = iter(tasks)
    running: deque[Future[T]] = deque()
    threads = ThreadPoolExecutor(max(1, ahead), thread_name_prefix="pipepool-read-ahead")
    try:
        for task in pending:
            running.append(threads.submit(task))
            if len(running) >= ahead:
                break
        while running:
            result = running.popleft().result()
            following = next(pending, None)
            if following is not None:  # before the taker goes: it computes while the taker works
                running.append(threads.submit(following))
            yield result
    finally:
        threads.shutdown(wait=False, cancel_futures=True)
