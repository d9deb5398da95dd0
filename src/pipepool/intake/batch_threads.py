"""The Rust tokenizer's batch calls on threads of this process's own (a server's front ends).

By default ``tokenizers`` spreads every batch call over one pool of threads for the whole
process, a thread a core, whose workers spin a while for more work after each call and take
a call only through a handoff from the calling thread. A server's front ends each hold such
a pool: eight front ends on 16 cores hold 128 of these threads, and at 32 texts a request
one tokenizer thread a front end (``RAYON_NUM_THREADS=1``) cost ~30% less front-end CPU a
request, the threads of this module 22-37% less (docs/benchmarks/served.md, "Front ends on
their own tokenizer threads").
A process that calls ``use_own_threads`` turns that pool off (the tokenizer's
``TOKENIZERS_PARALLELISM``, which it reads at each call) and runs each batch call on the
thread that makes it, without the interpreter's lock as before; only a large batch is split,
into parts of at least ``SPLIT_CHARS`` characters on threads of this module's own, so that a
large request still spreads over the cores.
"""

from __future__ import annotations

import os
import threading
from bisect import bisect_left
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate, pairwise
from typing import Any

from ..runtime.cores import usable_cpus

# Characters of a part, at least: ~2k tokens, a millisecond or two of one thread's work, far
# above what handing a part to another thread costs (tens of µs). A 32-query request (~3k
# characters) stays on its thread whole.
SPLIT_CHARS = 1 << 13
PARALLELISM = "TOKENIZERS_PARALLELISM"
# Set beside it by ``use_own_threads``: the switch is pipepool's, not the user's, in this
# process and in the processes it starts (another front end, started by this one, turns its
# own threads on as well).
OURS = "PIPEPOOL_OWN_TOKENIZER_THREADS"
# The variables by which a user chooses the Rust pool themselves: set, they are left alone.
_USER_CHOICE = (PARALLELISM, "RAYON_NUM_THREADS")


class BatchThreads:
    """``run(encode, items, **kwargs)``: ``encode(items, **kwargs)``'s list (a batch call of
    the Rust tokenizer, ``encode_batch`` or ``encode_batch_fast``), computed on the calling
    thread, or for items of ``2 * split_chars`` characters or more in up to ``threads`` parts
    of consecutive items, all but the first on this object's threads, joined in order. An
    exception of a part is raised here. Each part is a serial call only where the Rust pool is
    off (``use_own_threads``); otherwise each part spreads over that pool as well."""

    def __init__(self, threads: int, *, split_chars: int = SPLIT_CHARS) -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, not {threads}")
        self.threads = threads
        self.split_chars = split_chars
        self._pool = (
            ThreadPoolExecutor(threads - 1, thread_name_prefix="pipepool-encode")
            if threads > 1
            else None
        )

    def run(self, encode: Callable[..., list], items: list, **kwargs: Any) -> list:
        bounds = self._parts(items)
        if self._pool is None or len(bounds) < 3:
            return encode(items, **kwargs)
        pool = self._pool
        later = [
            pool.submit(encode, items[start:stop], **kwargs) for start, stop in pairwise(bounds[1:])
        ]
        try:
            out = encode(items[: bounds[1]], **kwargs)
        finally:
            done = [part.result() for part in later]  # waited for even if the first failed
        for part in done:
            out.extend(part)
        return out

    def close(self) -> None:
        """Stop the threads (parts in progress finish)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def _parts(self, items: list) -> list[int]:
        """Part boundaries [0, ..., len(items)]: up to ``threads`` parts of consecutive items,
        each but the last of at least ``1 / threads`` of the characters and ``split_chars``;
        [0, len(items)] for one part."""
        if len(items) < 2 or self.threads < 2:
            return [0, len(items)]
        sizes = list(accumulate(item_sizes(items)))
        parts = min(self.threads, len(items), sizes[-1] // self.split_chars)
        if parts < 2:
            return [0, len(items)]
        each = sizes[-1] / parts
        bounds = [0]
        while len(bounds) < parts:  # a part ends with the item that makes it ``each`` long
            before = sizes[bounds[-1] - 1] if bounds[-1] else 0
            cut = bisect_left(sizes, before + each, lo=bounds[-1]) + 1
            if cut >= len(items):
                break
            bounds.append(cut)
        bounds.append(len(items))
        return bounds


_own: BatchThreads | None = None
_switching = threading.Lock()


def use_own_threads(threads: int | None = None) -> bool:
    """From now on this process's batch calls (``run``) go on its own threads, ``threads``
    of them (default: the cores it may run on), and the Rust tokenizer's pool is off. Left as
    it is (False) where the user chose the Rust pool's size or switched it on or off
    (``TOKENIZERS_PARALLELISM``, ``RAYON_NUM_THREADS`` in the environment); True once on."""
    global _own
    with _switching:  # each model's engine owner calls it, on threads of their own
        if _own is not None:
            return True
        ours = os.environ.get(OURS) == "1"
        if not ours and any(name in os.environ for name in _USER_CHOICE):
            return False
        os.environ[PARALLELISM] = "false"
        os.environ[OURS] = "1"
        _own = BatchThreads(threads or usable_cpus())
        return True


def run(encode: Callable[..., list], items: list, **kwargs: Any) -> list:
    """``encode(items, **kwargs)`` as this process runs batch calls: through ``BatchThreads``
    once ``use_own_threads`` is on, else straight into the Rust tokenizer's pool."""
    own = _own
    if own is None:
        return encode(items, **kwargs)
    return own.run(encode, items, **kwargs)


def child_environ() -> dict[str, str]:
    """This process's environment for a child that tokenises with the Rust pool (a tokenizer
    helper process): without the switch ``use_own_threads`` set here or in a parent."""
    env = dict(os.environ)
    if env.get(OURS) == "1":
        del env[OURS]
        env.pop(PARALLELISM, None)
    return env


def item_sizes(items: list) -> list[int]:
    """Characters of each text or (first, second) pair: one C-level pass where all are texts
    (every batch call of a front end sizes its items here)."""
    if {*map(type, items)} == {str}:
        return list(map(len, items))
    return list(map(item_chars, items))


def item_chars(item: str | tuple[str, str]) -> int:
    """Characters of a text or of a (first, second) pair."""
    return len(item) if isinstance(item, str) else len(item[0]) + len(item[1])
