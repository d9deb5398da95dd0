"""``FastBodyRoute`` answers every request as FastAPI's own route does: the same status and
body for well-formed, malformed and mistyped bodies, other content types, and endpoints that
return a model instead of a Response."""

from __future__ import annotations

import pytest
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict

from pipepool.server.fast_route import FastBodyRoute


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input: list[str]
    n: int = 1


def _app(route_class: type | None) -> FastAPI:
    router = APIRouter(route_class=route_class) if route_class else APIRouter()

    @router.post("/answer")
    async def answer(body: Body, request: Request) -> Response:
        return Response(f"{body.input}:{body.n}:{request.url.path}", media_type="text/plain")

    @router.post("/model", response_model=Body)
    async def model(body: Body, request: Request) -> Body:
        return body

    app = FastAPI()
    app.include_router(router)
    return app


BODIES = [
    (b'{"input": ["a", "b"], "n": 3}', "application/json"),
    (b'{"input": ["a"]}', "application/json; charset=utf-8"),
    (b'{"input": ["a"], "n": "4"}', "application/json"),  # lax: "4" is 4 in both
    (b'{"input": ["a"], "n": 99999999999999999999999}', "application/json"),  # past orjson
    (b'{"input": ["a"], "n": NaN}', "application/json"),  # json.loads' extension
    (b'{"input": ["a"], "extra": 1}', "application/json"),
    (b'{"input": "a"}', "application/json"),
    (b'{"input": ["a"]', "application/json"),
    (b"", "application/json"),
    (b'{"input": ["a"]}', "text/plain"),
    (b'{"input": ["a"]}', ""),
    (b'{"input": ["a"]}', "application/vnd.api+json"),
]


@pytest.mark.parametrize("path", ["/answer", "/model"])
@pytest.mark.parametrize(("raw", "content_type"), BODIES)
def test_same_answer_as_fastapi(path: str, raw: bytes, content_type: str) -> None:
    headers = {"content-type": content_type} if content_type else {}
    answers = []
    for route_class in (None, FastBodyRoute):
        with TestClient(_app(route_class), raise_server_exceptions=False) as client:
            r = client.post(path, content=raw, headers=headers)
        answers.append((r.status_code, r.headers.get("content-type"), r.content))
    assert answers[0] == answers[1]


def test_routes_of_other_shapes_keep_fastapi_s_handler() -> None:
    router = APIRouter(route_class=FastBodyRoute)

    @router.post("/q")
    async def with_query(body: Body, request: Request, q: int = 0) -> dict:
        return {"q": q, "n": body.n}

    app = FastAPI()
    app.include_router(router)
    with TestClient(app) as client:
        r = client.post("/q?q=5", json={"input": ["a"], "n": 2})
    assert r.json() == {"q": 5, "n": 2}
