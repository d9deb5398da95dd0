"""One-text requests of one event-loop turn share an engine call (``server/joined_calls.py``):
which requests join, what each gets back (its own row, its own error), what leaving does; and,
through a real server under concurrent one-text requests, that every request's vector and
token count are transformers' for its own text while the requests shared calls."""

from __future__ import annotations

import asyncio
import contextvars

import httpx
import numpy as np
import pytest
from test_server import ServerProcess
from tiny_models import MIN_COSINE, Reference, cosine, long_prompts

from pipepool.core.request import PoolingParams
from pipepool.core.submission import Submission
from pipepool.errors import InvalidInputError
from pipepool.server.joined_calls import MAX_JOINED, Joinable, JoinedCalls

MEAN = PoolingParams("mean")


class _Engine:
    """Records each call's texts; its submissions finish when the test says."""

    def __init__(self, refuse: str | None = None) -> None:
        self.calls: list[list[str]] = []
        self.submissions: list[Submission] = []
        self.cancelled: list[Submission] = []
        self.refuse = refuse  # a text no call may hold

    def submit(self, texts: list[str]) -> Submission:
        if self.refuse in texts:
            raise InvalidInputError(f"input {texts.index(self.refuse)} is refused")
        self.calls.append(list(texts))
        submission = Submission(MEAN, len(texts), 2, on_cancel=self.cancelled.append)
        self.submissions.append(submission)
        return submission

    def finish(self, submission: Submission) -> None:
        n = submission.num_inputs
        submission.num_tokens[:] = np.arange(n) + 10
        submission.put_vectors(np.arange(n), np.arange(2 * n, dtype=np.float32).reshape(n, 2))


def _join(key: str) -> Joinable:
    return Joinable(key, lambda engine, texts: engine.submit(texts))


def _alone(text: str):
    return lambda engine: engine.submit([text])


async def _add(joined: JoinedCalls, engine: _Engine, key: str, texts: list[str]) -> list:
    """Every text added in one turn; the (call, row) or error of each, in order."""
    futures = [joined.add(engine, _join(key), t, _alone(t)) for t in texts]
    return await asyncio.gather(*futures, return_exceptions=True)


def test_one_turns_texts_of_one_key_make_one_call_and_each_reads_its_row():
    async def main() -> None:
        engine, joined = _Engine(), JoinedCalls()
        shared = await _add(joined, engine, "k", ["a", "b", "c"])
        assert engine.calls == [["a", "b", "c"]]
        assert [row for _, row in shared] == [0, 1, 2]
        assert (joined.calls, joined.requests) == (1, 3)
        engine.finish(engine.submissions[0])
        for call, row in shared:
            outputs, tokens = await call.wait(row)
            assert outputs.tolist() == [[2.0 * row, 2.0 * row + 1]]
            assert tokens == 10 + row

    asyncio.run(main())


def test_keys_turns_and_the_joined_bound_each_make_their_own_call():
    async def main() -> None:
        engine, joined = _Engine(), JoinedCalls()
        futures = [joined.add(engine, _join(k), t, _alone(t)) for k, t in
                   [("k", "a"), ("other", "b"), ("k", "c")]]  # fmt: skip
        await asyncio.gather(*futures)
        assert engine.calls == [["a", "c"], ["b"]]
        await _add(joined, engine, "k", ["d"])  # a later turn
        assert engine.calls[-1] == ["d"]
        many = [str(i) for i in range(MAX_JOINED + 3)]
        await _add(joined, engine, "k", many)
        assert engine.calls[-2:] == [many[:MAX_JOINED], many[MAX_JOINED:]]

    asyncio.run(main())


def test_a_refused_joined_call_is_made_again_request_by_request():
    async def main() -> None:
        engine, joined = _Engine(refuse="bad"), JoinedCalls()
        got = await _add(joined, engine, "k", ["a", "bad", "c"])
        assert engine.calls == [["a"], ["c"]]  # the joined one was refused before any call
        assert isinstance(got[1], InvalidInputError)
        assert "input 0" in str(got[1])  # the request's own call: its own index
        assert [row for _, row in (got[0], got[2])] == [0, 0]
        assert (joined.calls, joined.requests) == (0, 0)

    asyncio.run(main())


def test_requests_that_left_before_the_turn_are_not_submitted():
    async def main() -> None:
        engine, joined = _Engine(), JoinedCalls()
        futures = [joined.add(engine, _join("k"), t, _alone(t)) for t in "abc"]
        futures[1].cancel()
        await asyncio.gather(futures[0], futures[2])
        assert engine.calls == [["a", "c"]]

    asyncio.run(main())


def test_a_joined_call_is_cancelled_once_every_request_left():
    async def main() -> None:
        engine, joined = _Engine(), JoinedCalls()
        shared = await _add(joined, engine, "k", ["a", "b"])
        (call, _), (same, _) = shared
        assert call is same
        assert call.leave(0) is True  # unanswered when it left
        assert engine.cancelled == []  # request 1 still waits
        assert call.leave(1) is True
        assert engine.cancelled == [call.submission]

    asyncio.run(main())


def test_the_joined_call_runs_in_the_first_requests_context():
    client: contextvars.ContextVar[str] = contextvars.ContextVar("client", default="none")
    seen: list[str] = []

    def submit(engine, texts):
        seen.append(client.get())
        return engine.submit(texts)

    async def one(joined, engine, text):
        client.set(f"client of {text}")
        return await joined.add(engine, Joinable("k", submit), text, _alone(text))

    async def main() -> None:
        engine, joined = _Engine(), JoinedCalls()
        await asyncio.gather(one(joined, engine, "a"), one(joined, engine, "b"))
        assert seen == ["client of a"]

    asyncio.run(main())


# -- through a real server -------------------------------------------------------------------

BUDGET = 32  # small: every text below takes several chunked steps
MAX_TOKENS = 150  # --max-tokens-per-request: one text below is over it


@pytest.fixture(scope="module")
def server(qwen3_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("joined-log") / "server.log"
    flags = ["--model", str(qwen3_path), "--max-num-batched-tokens", str(BUDGET),
             "--max-tokens-per-request", str(MAX_TOKENS)]  # fmt: skip
    s = ServerProcess(flags, log).wait_ready()
    yield s
    s.proc.terminate()
    s.proc.wait(30)


def _joined_requests(server: ServerProcess) -> float:
    return next(v for k, v in server.metrics().items() if "joined_requests_total" in k)


@pytest.mark.slow
def test_concurrent_one_text_requests_each_get_their_own_vector_and_usage(server, qwen3_path):
    ref = Reference(qwen3_path)
    texts = [t for t in long_prompts() if len(ref.token_ids(t)) <= MAX_TOKENS]
    over = next(t for t in long_prompts() if len(ref.token_ids(t)) > MAX_TOKENS)
    assert len(texts) >= 3 and max(len(ref.token_ids(t)) for t in texts) > BUDGET
    sent = [texts[i % len(texts)] for i in range(40)] + [over]

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=len(sent))
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as c:
            return await asyncio.gather(
                *(c.post("/v1/embeddings", json={"input": t}) for t in sent)
            )

    # Which requests share a turn of the server's loop depends on when they arrive: bursts
    # until some did (the first, nearly always), each answer checked.
    for _ in range(5):
        before = _joined_requests(server)
        answers = asyncio.run(burst())
        assert answers[-1].status_code == 400, answers[-1].text
        assert "--max-tokens-per-request" in answers[-1].json()["error"]["message"]
        for text, r in zip(sent[:-1], answers[:-1], strict=True):
            assert r.status_code == 200, r.text
            ids = ref.token_ids(text)
            assert r.json()["usage"]["prompt_tokens"] == len(ids)
            got = np.array(r.json()["data"][0]["embedding"])
            assert cosine(got, ref.pooled(ids, "last")) >= MIN_COSINE
        if _joined_requests(server) > before:
            break
    assert _joined_requests(server) > before, "no two requests shared an engine call"
