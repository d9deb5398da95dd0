"""A replica queues one client's consecutive works as one call (``replicas/work_groups.py``):
which works join, how a call's finished rows go back work by work, and, through a real
``ReplicaServer`` over a socket pair, that every work's vectors are transformers' for its own
prompts while the pipeline saw one call."""

from __future__ import annotations

import socket
import threading
import time
from multiprocessing.connection import Connection

import numpy as np
import pytest
from tiny_models import MIN_COSINE, SENTENCES, cosine

import pipepool
from pipepool.core.request import PoolingParams
from pipepool.replicas.messages import Abort, Report, Stop, Work, receive, send
from pipepool.replicas.work_groups import WorkGroup, group_works
from pipepool.replicas.worker import ReplicaServer

MEAN = PoolingParams("mean", normalize=True)
CLIENT = "address:127.0.0.1"


def _work(first_id: int, lengths: list[int], **fields) -> Work:
    token_ids = np.arange(first_id * 100, first_id * 100 + sum(lengths), dtype=np.int64)
    fields = {"params": MEAN, "client": CLIENT, **fields}
    return Work(first_id, token_ids, np.array(lengths, dtype=np.int64), **fields)


def _ids(groups) -> list[list[int]]:
    return [g.first_ids for g in groups]


def test_one_clients_consecutive_works_with_one_key_share_a_call_in_order():
    works = [_work(0, [3]), _work(1, [2, 4]), _work(3, [5])]
    (group,) = group_works(works, max_tokens=100)
    assert group.first_ids == [0, 1, 3]
    assert group.lengths.tolist() == [3, 2, 4, 5]
    expected = np.concatenate([w.token_ids for w in works])
    assert np.array_equal(group.token_ids, expected)
    assert group.starts.tolist() == [0, 1, 3, 4]
    assert len(group) == 4


def test_works_join_only_consecutive_ones_of_one_client_key_and_within_the_token_bound():
    cls = PoolingParams("cls")
    works = [
        _work(0, [3]),
        _work(1, [3]),
        _work(2, [3], params=cls),  # other parameters
        _work(3, [3]),
        _work(4, [3], client="address:10.0.0.2"),  # another client
        _work(5, [3], client=None),  # no client: each call its own turn
        _work(6, [3]),
        _work(7, [3], background=True),  # batch-job work
        _work(8, [3], type_ids=np.zeros(3, dtype=np.int64)),  # a pair input
        _work(9, [3], key_lens=np.array([2])),
        _work(10, [3]),
        _work(11, [3]),
        _work(12, [3]),  # 9 tokens with the two before: over the bound of 8
        _work(13, [9]),  # alone over the bound
        _work(14, [3]),
    ]
    assert _ids(group_works(works, max_tokens=8)) == [
        [0, 1], [2], [3], [4], [5], [6], [7], [8], [9], [10, 11], [12], [13], [14],
    ]  # fmt: skip


def test_a_calls_rows_go_back_to_their_works_in_any_order():
    group = WorkGroup([_work(0, [3]), _work(1, [2, 4]), _work(3, [5, 1, 1])])
    values = np.arange(6 * 2, dtype=np.float32).reshape(6, 2)
    rows = np.array([5, 1, 0, 3, 2, 4])  # a length-sorted step's order
    got = {r.first_id: r for r in group.results(rows, values, 0.25)}
    assert sorted(got) == [0, 1, 3]
    for first_id, start in ((0, 0), (1, 1), (3, 3)):
        result = got[first_id]
        assert result.replica_s == 0.25
        assert len(result.values) == len(result.rows)
        for row, value in zip(result.rows.tolist(), result.values, strict=True):
            assert np.array_equal(value, values[rows.tolist().index(start + row)])
    # Token outputs (ALL pooling) are a list of arrays: split the same way.
    tokens = [np.full((2, 2), r, dtype=np.float32) for r in rows.tolist()]
    got = {r.first_id: r for r in group.results(rows, tokens, 0.0)}
    assert [float(v[0, 0]) for v in got[3].values] == [5.0, 3.0, 4.0]
    assert got[3].rows.tolist() == [2, 0, 1]


def test_one_prompt_works_each_get_their_row_and_dropped_works_get_none():
    group = WorkGroup([_work(i, [2]) for i in range(4)])
    values = np.arange(4 * 3, dtype=np.float32).reshape(4, 3)
    assert group.drop(2) is False
    results = group.results(np.array([3, 2, 0]), values[[3, 2, 0]], 0.0)
    assert [r.first_id for r in results] == [3, 0]
    assert [r.rows.tolist() for r in results] == [[0], [0]]
    assert np.array_equal(results[0].values, values[3:4])
    assert np.array_equal(results[1].values, values[0:1])
    assert group.drop(2) is False  # twice is once
    assert group.drop(0) is False and group.drop(1) is False
    assert group.drop(3) is True  # none left: the call may be cancelled
    assert group.results(np.array([1]), values[1:2], 0.0) == []


class _CountingPipeline:
    """A real pipeline that counts the calls queued on it."""

    def __init__(self, pipeline) -> None:
        self._pipeline = pipeline
        self.calls: list[int] = []  # inputs of each call queued

    def __getattr__(self, name: str):
        return getattr(self._pipeline, name)

    def enqueue(self, submission, part) -> None:
        self.calls.append(len(part.lengths))
        self._pipeline.enqueue(submission, part)


@pytest.fixture
def replica(bert_path):
    """(engine, the counting pipeline, the front end's end of a ReplicaServer's socket)."""
    with pipepool.Engine(str(bert_path)) as engine:
        ours, theirs = socket.socketpair()
        front, back = Connection(ours.detach()), Connection(theirs.detach())
        counting = _CountingPipeline(engine.pipeline)
        server = ReplicaServer(counting, back, owner=False)
        serving = threading.Thread(target=server.run, daemon=True)
        serving.start()
        yield engine, counting, front, bert_path
        send(front, [Stop()])
        serving.join(10)
        front.close()


def _answers(front: Connection, wanted: set[int], timeout_s: float = 30.0) -> dict:
    """first id -> {row: vector}, until every work of ``wanted`` has all it asked for."""
    got: dict[int, dict[int, np.ndarray]] = {}
    deadline = time.monotonic() + timeout_s
    while not wanted.issubset(k for k, rows in got.items() if rows and None not in rows):
        assert time.monotonic() < deadline, f"answered so far: {sorted(got)}"
        if not front.poll(0.5):
            continue
        for message in receive(front):
            if isinstance(message, Report):
                for result in message.results:
                    rows = got.setdefault(result.first_id, {})
                    rows.update(zip(result.rows.tolist(), result.values, strict=True))
    return got


def test_a_frame_of_one_clients_works_is_one_call_and_each_work_gets_its_vectors(
    replica, reference
):
    engine, counting, front, path = replica
    ref = reference(path)
    texts = SENTENCES[:7]
    ids = engine.tokenize(texts)
    sizes = [1, 2, 1, 3]  # prompts per work
    works, first, start = [], 10, 0
    for n in sizes:
        chunk = ids[start : start + n]
        token_ids = np.concatenate(chunk).astype(np.int64)
        lengths = np.array([len(t) for t in chunk], dtype=np.int64)
        works.append(Work(first, token_ids, lengths, MEAN, client=CLIENT))
        first, start = first + n, start + n
    assert sum(len(t) for t in ids) <= engine.pipeline.light_tokens  # one group
    send(front, works)
    got = _answers(front, {w.first_id for w in works})
    assert counting.calls == [7]  # the frame's works queued as one call
    start = 0
    for work, n in zip(works, sizes, strict=True):
        rows = got[work.first_id]
        assert sorted(rows) == list(range(n))
        for row in range(n):
            want = ref.pooled(ref.token_ids(texts[start + row]), "mean")
            assert cosine(rows[row], want) >= MIN_COSINE
        start += n


class _HoldingPipeline(_CountingPipeline):
    """Keeps the calls queued on it (computes none): what an abort finds before any step."""

    def __init__(self, pipeline) -> None:
        super().__init__(pipeline)
        self.submissions: list = []

    def enqueue(self, submission, part) -> None:
        self.calls.append(len(part.lengths))
        self.submissions.append(submission)


def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the replica's reader did not get there"
        time.sleep(0.01)


def test_a_call_is_cancelled_once_every_one_of_its_works_is_aborted(bert_path):
    with pipepool.Engine(str(bert_path)) as engine:
        ours, theirs = socket.socketpair()
        front, back = Connection(ours.detach()), Connection(theirs.detach())
        holding = _HoldingPipeline(engine.pipeline)
        serving = threading.Thread(target=ReplicaServer(holding, back, owner=False).run)
        serving.start()
        send(front, [_work(0, [3]), _work(1, [2]), _work(2, [4]), Abort((0, 1))])
        _until(lambda: holding.calls == [3])
        send(front, [_work(7, [3])])  # frames are read in order: the abort came before it
        _until(lambda: holding.calls == [3, 1])
        (call, _) = holding.submissions
        assert not call.cancelled()  # work 2 is still wanted
        send(front, [Abort((2,))])
        _until(call.cancelled)
        send(front, [Stop()])
        serving.join(10)
        front.close()
