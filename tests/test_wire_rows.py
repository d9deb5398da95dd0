"""Vectors written a matrix at a time are what writing them one at a time gives: the same
base64 strings, float lists, binary bodies and metadata, for every wire dtype, byte order and
width; orjson's JSON reads back as the same numbers as the standard library's; and a large
answer serialised in blocks (``lock_blocks``) is the bytes of one call."""

from __future__ import annotations

import json

import numpy as np
import orjson
import pytest

from pipepool.server import lock_blocks
from pipepool.server.encoding import Wire, binary_response, encode_array, encode_rows

DTYPES = ["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
# Widths whose rows are whole 3-byte groups in some dtypes and not in others (384 x 4 bytes
# is, 1024 x 4 is not; 1 x 2 bytes is not).
WIDTHS = [1, 2, 3, 5, 64, 384, 1024]


def _matrix(n: int, width: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Values over many magnitudes, so that rounding and exponents differ row to row.
    scale = 10.0 ** rng.integers(-8, 3, size=(n, width))
    return (rng.standard_normal((n, width)) * scale).astype(np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("endianness", ["little", "big", "native"])
def test_base64_rows_match_one_at_a_time(dtype, width, endianness):
    matrix = _matrix(7, width)
    one_by_one = [encode_array(row, "base64", dtype, endianness) for row in matrix]
    assert encode_rows(matrix, "base64", dtype, endianness) == one_by_one


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 5, 384])
def test_float_rows_match_one_at_a_time(dtype, width):
    matrix = _matrix(6, width, seed=1)
    one_by_one = [encode_array(row, "float", dtype) for row in matrix]
    rows = encode_rows(matrix, "float", dtype)
    assert b"".join(lock_blocks.dumps(rows)) == _one_call(one_by_one)


def test_rows_of_a_list_and_of_nothing():
    """Arrays of different shapes (token outputs) go one at a time; no rows, no strings."""
    arrays = [_matrix(2, 4), _matrix(3, 4, seed=2)]
    assert encode_rows(arrays, "base64") == [encode_array(a, "base64") for a in arrays]
    assert encode_rows(np.zeros((0, 8), np.float32), "base64") == []


@pytest.mark.parametrize("fmt", ["bytes", "bytes_only"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8_e5m2"])
@pytest.mark.parametrize("endianness", ["little", "big"])
def test_binary_body_of_a_matrix_matches_per_vector(fmt, dtype, endianness):
    matrix = _matrix(5, 7)
    wire = Wire(fmt, dtype, endianness)
    head = {"id": "embd-1", "created": 1, "model": "m"}
    whole = binary_response(matrix, wire, head, [3] * 5)
    rows = binary_response(list(matrix), wire, head, [3] * 5)
    assert whole.body == rows.body
    assert whole.headers.get("metadata") == rows.headers.get("metadata")
    if fmt == "bytes":
        items = json.loads(whole.headers["metadata"])["data"]
        assert [(d["start"], d["end"]) for d in items][-1][1] == len(whole.body)


def test_json_bytes_reads_back_as_the_standard_librarys_numbers():
    matrix = _matrix(16, 384, seed=3)
    value = {"data": [{"index": i, "embedding": row} for i, row in enumerate(matrix.tolist())]}
    theirs = json.loads(json.dumps(value))
    ours = json.loads(b"".join(lock_blocks.dumps(value)))
    assert ours == theirs  # float equality: every number the same double
    assert json.loads(b"".join(lock_blocks.dumps({1: "a"}))) == json.loads(json.dumps({1: "a"}))


def _one_call(value) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)


def test_a_large_answer_in_blocks_is_the_bytes_of_one_call():
    matrix = _matrix(2048, 384, seed=4)
    rows = encode_rows(matrix, "float")
    lists = matrix.tolist()
    assert [row.tolist() for row in rows] == lists  # float64 rows: the same numbers

    def answer_of(vectors):
        return {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": r} for i, r in enumerate(vectors)
            ],
            "model": "m",
            "usage": {"prompt_tokens": 7, "total_tokens": 7},
        }

    parts = lock_blocks.dumps(answer_of(rows))
    assert len(parts) > 2048 * 384 // lock_blocks.LOCK_VALUES  # a block of rows a part at least
    assert b"".join(parts) == _one_call(answer_of(lists))  # the bytes of the lists in one call
    # TEI's shape (the list itself), two large lists in one answer, a small answer.
    assert b"".join(lock_blocks.dumps(rows)) == _one_call(lists)
    # Rows of any layout (a Fortran-ordered matrix's are strided) are written all the same.
    strided = encode_rows(np.asfortranarray(matrix[:8]), "float")
    assert b"".join(lock_blocks.dumps(strided)) == _one_call(lists[:8])
    rows = lists
    two = {"a": rows[:1000], 3: "x", "b": [[1.5] * 100] * 400}
    assert len(lock_blocks.dumps(two)) > 3 and b"".join(lock_blocks.dumps(two)) == _one_call(two)
    small = {"data": rows[:4]}
    assert lock_blocks.dumps(small) == [_one_call(small)]


def test_an_answer_holding_the_placeholders_text_is_serialised_whole():
    rows = _matrix(200, 384, seed=5).tolist()
    answer = {"data": rows, "document": lock_blocks._PLACEHOLDER.format(0)}
    assert lock_blocks.dumps(answer) == [_one_call(answer)]
    other = {"data": rows, "document": lock_blocks._PLACEHOLDER.format(1)}  # not the one used
    assert len(lock_blocks.dumps(other)) > 1
    assert b"".join(lock_blocks.dumps(other)) == _one_call(other)
