"""What the HTTP stack alone costs a one-text ``/v1/embeddings`` request: the server's CPU time a
request (from ``/proc``) for apps that answer a fixed embedding body, with no model behind them.

    python benchmarks/asgi_floor.py --rounds 3

Each app is a uvicorn server of its own (uvloop, httptools, as ``pipepool serve`` runs it),
started one after the other each round; each is loaded with the same bodies (one text, base64,
as the ``openai`` client sends them) from ``--clients`` processes (``dp_server.run_pass``):

- ``asgi``: a bare ASGI callable (reads the body, parses it with orjson, answers);
- ``fastapi``: FastAPI's own route, the body a pydantic model;
- ``fast_route``: the same endpoint on a ``FastBodyRoute`` (``server/fast_route.py``);
- ``direct``: that route reached past the router (``server/direct_routes.py``);
- ``doors``: ``direct`` behind pipepool's own middleware as ``server/app.py`` mounts it (the
  online gate, the front door with its metrics, timing and guards, the refusals' pacing), at
  ``ServerSettings``' defaults.

The gap between ``asgi`` and the others is the framework's per-request work; pipepool's own
(its middleware, the engine call, tokenising, the answer) comes on top in a real server
(``served_processes.py``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import httpx
from dp_server import run_pass
from fastapi import APIRouter, FastAPI, Request, Response
from pydantic import BaseModel
from served import cpu_seconds

ANSWER = json.dumps(
    {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": "A" * 512}],
        "model": "m",
        "usage": {"prompt_tokens": 8, "total_tokens": 8},
    },
    separators=(",", ":"),
).encode()

APPS = ("asgi", "fastapi", "fast_route", "direct", "doors")


class Body(BaseModel):
    """The request's body as the FastAPI apps read it (at module level: FastAPI resolves the
    endpoint's annotations, ``Request`` too, in this module's names)."""

    input: list[str]
    model: str
    encoding_format: str = "float"


def build(kind: str):
    """The ASGI app of ``kind`` (one of ``APPS``)."""
    import orjson

    if kind == "asgi":

        async def app(scope, receive, send) -> None:
            if scope["type"] != "http":
                return
            body, more = b"", True
            while more:
                message = await receive()
                body += message.get("body", b"")
                more = message.get("more_body", False)
            orjson.loads(body)
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(ANSWER)),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": ANSWER})

        return app

    from pipepool.server.direct_routes import DirectRoutes
    from pipepool.server.fast_route import FastBodyRoute

    router = APIRouter(route_class=FastBodyRoute) if kind != "fastapi" else APIRouter()

    @router.post("/v1/embeddings")
    async def embeddings(body: Body, request: Request) -> Response:
        return Response(ANSWER, media_type="application/json")

    app = FastAPI()
    app.include_router(router)
    if kind in ("direct", "doors"):
        handlers = app.exception_handlers
        app.add_middleware(DirectRoutes, routes=router.routes, exception_handlers=handlers)
    if kind == "doors":
        from pipepool.server.front_door import FrontDoor
        from pipepool.server.metrics import HttpMetrics
        from pipepool.server.online_gate import OnlineRequests
        from pipepool.server.refusal_pacing import RefusalPacing
        from pipepool.server.settings import ServerSettings

        metrics = HttpMetrics(frozenset({"/v1/embeddings"}))
        app.add_middleware(RefusalPacing)
        app.add_middleware(FrontDoor, settings=ServerSettings(), metrics=metrics)
        app.add_middleware(OnlineRequests)
    return app


def serve(kind: str, port: int) -> None:
    import uvicorn

    uvicorn.run(build(kind), host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                access_log=False, log_level="warning")  # fmt: skip


def start(kind: str, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port", str(port)])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the {kind} server exited with {proc.returncode}")
        try:
            body = {"input": ["a"], "model": "m"}
            httpx.post(f"http://127.0.0.1:{port}/v1/embeddings", json=body)
            return proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"the {kind} server did not answer in 60 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8192)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--port", type=int, default=8871)
    parser.add_argument("--apps", default=",".join(APPS))
    parser.add_argument("--serve", choices=APPS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return
    texts = [f"query number {i} about a thing" for i in range(args.requests)]
    bodies = [
        json.dumps({"input": [text], "model": "m", "encoding_format": "base64"}).encode()
        for text in texts
    ]
    url = f"http://127.0.0.1:{args.port}"
    for round_ in range(args.rounds):
        for kind in args.apps.split(","):
            proc = start(kind, args.port)
            try:
                run_pass(url, bodies[:1024], args.clients, args.concurrency)
                before = cpu_seconds(proc.pid)
                seconds, _, failed, _, _ = run_pass(url, bodies, args.clients, args.concurrency)
                spent = cpu_seconds(proc.pid) - before
            finally:
                proc.terminate()
                proc.wait(30)
            n = len(bodies)
            print(f"round {round_ + 1}, {kind}: {n / seconds:,.0f} requests/s, server CPU "
                  f"{spent * 1e6 / n:.0f} us a request, {failed} failed", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
