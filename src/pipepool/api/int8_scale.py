"""int8/uint8 embeddings on one fixed scale per model, so that they mean what Cohere's int8
embeddings mean: the same text gets the same integers in any call and any batch, and an
integer vector approximates its float vector (a vector database compares them directly).

The rule (``quantize_symmetric``): int8 = ``round(127 * v / c)`` clipped to -127..127, uint8 =
int8 + 128, with ``c`` the model's *bound*: the largest magnitude of any component of the
model's vectors of the fixed ``CALIBRATION_TEXTS``, rounded up to the next multiple of 1/8 of
its power of two (a bound in [2^e, 2^(e+1)) becomes a multiple of 2^(e-3); 0.20995 becomes
0.21875). The rounding keeps float noise (another batch, another device) from moving ``c``,
unless the largest component lies within that noise of a multiple; it costs at most 1/8 of
the resolution. One scale for every dimension keeps the vector's direction: for
all-MiniLM-L6-v2, cos(int8, float) >= 0.9999. A component beyond ``c`` is clipped to ±127.
(Snowflake's arctic-embed models publish one fixed range per model in the same spirit.)

The integers are a function of the float vector alone; where the engine's float vector of a
text in another batch differs by float rounding (~1e-7), a component within that of a rounding
edge lands one step over (all-MiniLM-L6-v2, 300 texts alone and in one batch: 1 component of
115,200).

When: ``Int8Calibration`` computes each bound the first time it is asked for (one engine call
on the 64 short calibration texts: ~0.2 s for all-MiniLM-L6-v2 on 2 CPU cores, one batch on a
GPU) and keeps it for its owner's life (``Engine.int8_bound``'s for the engine's, a
``SentenceTransformer`` adapter's for ``encode``'s own kinds of vector); an engine restarted
on the same model and device computes the same bound from the same texts.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from .calibration_texts import CALIBRATION_TEXTS

# Multiples of 2^-_OCTAVE_STEPS of a bound's power of two.
_OCTAVE_STEPS = 3


def symmetric_bound(vectors: np.ndarray | list[np.ndarray]) -> float:
    """The bound of the rule for these vectors (``[n, dim]``, or a list of ``[len, dim]``
    matrices): their largest finite magnitude, rounded up as the module says; 1.0 where every
    value is 0 (any bound gives 0 then)."""
    if isinstance(vectors, list):
        vectors = np.concatenate([np.ravel(v) for v in vectors])
    values = np.abs(np.asarray(vectors, dtype=np.float64))
    largest = float(values[np.isfinite(values)].max(initial=0.0))
    if largest == 0.0:
        return 1.0
    _, exponent = math.frexp(largest)  # largest in [2^(exponent-1), 2^exponent)
    step = math.ldexp(1.0, exponent - 1 - _OCTAVE_STEPS)
    return math.ceil(largest / step) * step


class Int8Calibration:
    """One engine's bounds, one per kind of vector (a key: the call's options that shape its
    vectors, such as ``dimensions``). ``bound(key, embed)`` computes the bound of
    ``embed(CALIBRATION_TEXTS)`` the first time ``key`` is asked for; every later call, from
    any thread, gets that same number. Thread-safe; a failed computation stores nothing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bounds: dict[Hashable, float] = {}

    def known(self, key: Hashable) -> float | None:
        """The bound of ``key`` if computed already, else None; never waits."""
        return self._bounds.get(key)

    def bound(self, key: Hashable, embed: Callable[[list[str]], Any]) -> float:
        with self._lock:  # one computation per key, whoever asks first
            if key not in self._bounds:
                self._bounds[key] = symmetric_bound(embed(list(CALIBRATION_TEXTS)))
            return self._bounds[key]
