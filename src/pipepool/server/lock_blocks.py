"""Large answers serialised in blocks, so that no single C call holds the interpreter's lock
for long.

``orjson.dumps`` holds the lock for the whole of one call. A 2,048 × 384 float answer took
28 ms in one ``ndarray.tolist`` and 31 ms in one ``dumps`` of those lists (2-core EPYC): every
other thread of the server waited that long, the engine's loop between its steps and the light
clients' requests included (issue 57's hostile loads). Between two blocks the interpreter may
hand the lock to another thread, so the longest hold is a block's (``LOCK_VALUES`` values,
about 0.3 ms there, by the one-call times above). Measured there at the front ends' 0.5 ms
switch interval: a socket round trip of another thread beside such an answer's serialisation
took a median 0.80-0.81 ms with blocks of 8,192 values against 1.47-1.67 at 32,768 (p90
1.8-2.0 against 2.8-2.9), the answer itself ~42-49 ms either way; 2,048 gained nothing more.
The bytes are exactly those of one call: orjson's compact output of a list is its items'
outputs joined by commas. They stay in parts, sent one after the other
(``routes.answers.PartsResponse``): joining them would be one more long copy.

Vectors are never made Python floats: :func:`rows_as_arrays` gives float64 views of the rows,
which orjson writes from the array (``OPT_SERIALIZE_NUMPY``) as the very text of the floats
``tolist`` would give (each float32 widened exactly; NaN and infinities null). That answer in
blocks: 19.1 ms against 35.7 through lists (best of 5, the same kind of core).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

# Values (floats, or sixteen characters of a string) one call serialises at most.
LOCK_VALUES = 8_192
_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY
# Stands for a large list in the answer around it; a string no JSON text of ours holds.
_PLACEHOLDER = "\x00pipepool-rows-{}\x00"


def rows_as_arrays(matrix: np.ndarray) -> list[np.ndarray]:
    """The rows of ``matrix`` [n, D] as float64 views of one widened, C-ordered copy (orjson
    writes only C-contiguous arrays): :func:`dumps` writes each as ``matrix.tolist()``'s row
    would be written, without the Python floats."""
    return list(np.ascontiguousarray(matrix, dtype=np.float64))


def dumps(value: Any) -> list[bytes]:
    """``value`` as compact JSON by orjson, in parts to be sent back to back: the numbers of
    ``json.dumps``, each float the shortest text that reads back as the same float (``1e-05``
    written ``0.00001``), ~20x faster on the thousands of floats of a batch of vectors; NaN and
    infinities null (strict JSON); keys may be ints, as ``json.dumps`` allows. A list of more
    than ``LOCK_VALUES`` values (the value itself, or one of a dict's values) is serialised a
    block of its items at a time; else one part. The parts are never joined here: one copy of
    a 15 MB answer holds the lock 10-20 ms by itself."""
    if isinstance(value, list) and _weight(value) > LOCK_VALUES:
        return _list(value)
    if not isinstance(value, dict):
        return [orjson.dumps(value, option=_OPTIONS)]
    large = {k: v for k, v in value.items() if isinstance(v, list) and _weight(v) > LOCK_VALUES}
    if not large:
        return [orjson.dumps(value, option=_OPTIONS)]
    marks = {k: _PLACEHOLDER.format(i) for i, k in enumerate(large)}
    text = orjson.dumps({k: marks.get(k, v) for k, v in value.items()}, option=_OPTIONS)
    # The answer around the large lists, cut where each one goes (in the order they appear).
    quoted = {orjson.dumps(mark): key for key, mark in marks.items()}
    places = sorted((text.find(q), q) for q in quoted)
    if any(at < 0 or text.count(q) != 1 for at, q in places):  # a placeholder's text is in
        return [orjson.dumps(value, option=_OPTIONS)]  # the answer itself: in one call
    parts, done = [], 0
    for at, q in places:
        parts.append(text[done:at])
        parts.extend(_list(large[quoted[q]]))
        done = at + len(q)
    parts.append(text[done:])
    return parts


def _list(items: list) -> list[bytes]:
    """A non-empty list's JSON as parts, a block of items at a time."""
    step = max(1, LOCK_VALUES // max(1, _weight(items[0])))
    parts = [b"["]
    for lo in range(0, len(items), step):
        block = orjson.dumps(items[lo : lo + step], option=_OPTIONS)
        parts.append(block[1:-1] if lo == 0 else b"," + block[1:-1])
    parts.append(b"]")
    return parts


def _weight(value: Any) -> int:
    """About how many values ``value`` holds, its first item standing for the others."""
    if isinstance(value, np.ndarray):
        return value.size or 1
    if isinstance(value, list):
        return len(value) * _weight(value[0]) if value else 1
    if isinstance(value, dict):
        return sum(_weight(v) for v in value.values()) or 1
    if isinstance(value, str):
        return len(value) // 16 + 1
    return 1
