"""Small calls that arrive together tokenised as one batch.

Threads that each tokenise a few texts (a server's requests on its tokenising threads, an
application calling ``Engine.embed`` from many threads) would each make a call of their own
into the Rust tokenizer: one text at a time with the interpreter's lock held, or a batch call
too small to spread over the cores. Here the first caller tokenises whatever has queued by
then in one batch call, without the lock, and the calls that came meanwhile queue for the next
batch, which the first of them tokenises once the batch before it is done (group commit). A
call alone goes straight through; a call never waits for more than the batch in progress.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any


class SharedBatches:
    """``encodings(texts)``: ``encode``'s results for ``texts``, computed in one call of
    ``encode`` with the texts of every call queued at the time (in order of arrival). An
    exception of ``encode`` is raised to every call of its batch. Thread-safe: one batch at a
    time, each caller woken once (its batch done, or its turn to tokenise the next)."""

    def __init__(self, encode: Callable[[list[str]], Sequence[Any]]) -> None:
        self._encode = encode
        self._lock = threading.Lock()
        self._queued: list[_Call] = []
        self._busy = False  # a caller is tokenising a batch

    def encodings(self, texts: list[str]) -> list:
        call = _Call(texts)
        with self._lock:
            self._queued.append(call)
            leads, self._busy = not self._busy, True
        if not leads:
            try:
                call.woken.wait()
            except BaseException:  # interrupted (Ctrl-C): out of the queue, the turn passed on
                self._leave(call)
                raise
            if call.done:  # a batch of someone else's took it
                return call.result()
        with self._lock:  # this caller's turn: everything queued by now
            batch, self._queued = self._queued, []
        try:
            self._run(batch)
        finally:
            with self._lock:
                if self._queued:  # the first to come meanwhile tokenises the next batch
                    self._queued[0].woken.set()
                else:
                    self._busy = False
        return call.result()

    def _leave(self, call: _Call) -> None:
        with self._lock:
            if call in self._queued:
                self._queued.remove(call)
                if call.woken.is_set() and not call.done:  # it was its turn
                    if self._queued:
                        self._queued[0].woken.set()
                    else:
                        self._busy = False

    def _run(self, batch: list[_Call]) -> None:
        texts = [t for c in batch for t in c.texts] if len(batch) > 1 else batch[0].texts
        try:
            out = self._encode(texts)
        except BaseException as exc:
            for c in batch:
                c.error = exc
                c.finish()
            return
        start = 0
        for c in batch:
            c.value = out[start : start + len(c.texts)]
            start += len(c.texts)
            c.finish()


class _Call:
    """One caller's texts, and their encodings once done."""

    __slots__ = ("done", "error", "texts", "value", "woken")

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts
        self.value: Sequence[Any] = ()
        self.error: BaseException | None = None
        self.done = False
        self.woken = threading.Event()  # done, or its turn to tokenise

    def finish(self) -> None:
        self.done = True
        self.woken.set()

    def result(self) -> list:
        if self.error is not None:
            raise self.error
        return list(self.value)
