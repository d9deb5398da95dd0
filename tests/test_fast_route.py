"""``FastBodyRoute`` answers every request as FastAPI's own route does, and so does the app with
``DirectRoutes`` in front of its router: the same status and body for well-formed, malformed
and mistyped bodies, other content types, endpoints that return a model instead of a Response,
errors the app's handlers answer, and methods the route does not take."""

from __future__ import annotations

import pytest
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict

from pipepool.server.direct_routes import DirectRoutes
from pipepool.server.fast_route import FastBodyRoute


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input: list[str]
    n: int = 1


class Refused(Exception):
    """An error the app's own handler answers."""


#: FastAPI's route; the fast route; the fast route reached past the router.
KINDS = ["fastapi", "fast", "direct"]


def _app(kind: str) -> FastAPI:
    router = APIRouter(route_class=FastBodyRoute) if kind != "fastapi" else APIRouter()

    @router.post("/answer")
    async def answer(body: Body, request: Request) -> Response:
        return Response(f"{body.input}:{body.n}:{request.url.path}", media_type="text/plain")

    @router.post("/model", response_model=Body)
    async def model(body: Body, request: Request) -> Body:
        return body

    @router.post("/refuse")
    async def refuse(body: Body, request: Request) -> Response:
        raise Refused(f"no {body.n}")

    app = FastAPI()
    app.include_router(router)

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Exception) -> Response:
        return Response(f"refused: {exc} at {request.url.path}", status_code=409)

    if kind == "direct":
        app.add_middleware(
            DirectRoutes, routes=router.routes, exception_handlers=app.exception_handlers
        )
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


@pytest.mark.parametrize("path", ["/answer", "/model", "/refuse"])
@pytest.mark.parametrize(("raw", "content_type"), BODIES)
def test_same_answer_as_fastapi(path: str, raw: bytes, content_type: str) -> None:
    headers = {"content-type": content_type} if content_type else {}
    answers = []
    for kind in KINDS:
        with TestClient(_app(kind), raise_server_exceptions=False) as client:
            r = client.post(path, content=raw, headers=headers)
        answers.append((r.status_code, r.headers.get("content-type"), r.content))
    assert answers[0] == answers[1] == answers[2]


@pytest.mark.parametrize("method", ["GET", "PUT", "HEAD"])
def test_other_methods_answered_by_the_router(method: str) -> None:
    answers = []
    for kind in KINDS:
        with TestClient(_app(kind), raise_server_exceptions=False) as client:
            r = client.request(method, "/answer", json={"input": ["a"]})
        answers.append((r.status_code, r.headers.get("allow"), r.content))
    assert answers[0] == answers[1] == answers[2]
    assert answers[0][0] == 405


def test_a_mounted_app_s_routes_keep_the_router() -> None:
    """Under a root path the router matches the path without it: never the direct way."""
    answers = []
    for kind in KINDS:
        with TestClient(_app(kind), root_path="/under") as client:
            r = client.post("/under/answer", json={"input": ["a"]})
        answers.append((r.status_code, r.content))
    assert answers[0] == answers[1] == answers[2]


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


def test_a_fast_body_goes_past_the_router() -> None:
    """A route given to ``DirectRoutes`` but never included in the app's router: its fast
    bodies are answered (the direct way), any other body reaches the router (404)."""
    router = APIRouter(route_class=FastBodyRoute)

    @router.post("/aside")
    async def aside(body: Body, request: Request) -> Response:
        return Response(f"aside {body.n}", media_type="text/plain")

    app = FastAPI()
    app.add_middleware(DirectRoutes, routes=router.routes, exception_handlers={})
    with TestClient(app) as client:
        assert client.post("/aside", json={"input": ["a"], "n": 2}).text == "aside 2"
        assert client.post("/aside", json={"input": "a"}).status_code == 404
