"""A call's slices tokenised ahead of the thread that enqueues them.

``Engine.submit`` enqueues a call's token slices one after the other, and after each it may
wait for the engine (``driver.pacing.IntakePacer``). Tokenised on that thread, the next slice
would start only once the last was enqueued and the wait was over: the tokenizer idle while
the device computes, the device idle while the tokenizer works. Here a thread of the call's
own tokenises the next slices meanwhile, a bounded number of them, so a call of any size holds
a few slices at a time.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")

# Slices tokenised and not yet taken, at most. Two keep the tokenizer busy through a wait of
# the enqueueing thread of up to two slices' tokenising; more would only hold memory.
AHEAD = 2


def read_ahead(produce: Callable[[], Iterator[T]], ahead: int = AHEAD) -> Iterator[T]:
    """The items of ``produce()``, in order, computed on a thread of their own up to ``ahead``
    items before they are taken. An exception raised by ``produce()`` is raised here when the
    item it stopped at is taken. Closing this iterator (or dropping it) stops the thread after
    the item it is computing, which is dropped."""
    box = _Box(ahead)
    thread = threading.Thread(
        target=box.fill, args=(produce,), name="pipepool-read-ahead", daemon=True
    )
    thread.start()
    try:
        while True:
            done, item, error = box.take()
            if error is not None:
                raise error
            if done:
                return
            yield item
    finally:
        box.stop()


class _Box:
    """The items between the producing thread and the taker: at most ``ahead`` of them."""

    def __init__(self, ahead: int) -> None:
        self._ahead = max(1, ahead)
        self._changed = threading.Condition()
        self._items: deque[tuple[bool, object, BaseException | None]] = deque()
        self._stopped = False

    def fill(self, produce: Callable[[], Iterator]) -> None:
        """The producing thread: ``produce()``'s items until it ends, fails or is stopped."""
        items = None
        try:
            items = produce()
            while self._room():
                try:
                    item = next(items)
                except StopIteration:
                    self._put((True, None, None))
                    return
                self._put((False, item, None))
        except BaseException as exc:  # the taker's to raise, in order
            self._put((False, None, exc))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    def _room(self) -> bool:
        """Wait for room for one more item; False once stopped."""
        with self._changed:
            self._changed.wait_for(lambda: len(self._items) < self._ahead or self._stopped)
            return not self._stopped

    def _put(self, entry: tuple[bool, object, BaseException | None]) -> None:
        with self._changed:
            self._items.append(entry)
            self._changed.notify_all()

    def take(self) -> tuple[bool, object, BaseException | None]:
        """The next entry: (ended, item, exception)."""
        with self._changed:
            self._changed.wait_for(lambda: bool(self._items))
            entry = self._items.popleft()
            self._changed.notify_all()
            return entry

    def stop(self) -> None:
        """No more items wanted: the producing thread ends after the one it computes."""
        with self._changed:
            self._stopped = True
            self._items.clear()
            self._changed.notify_all()
