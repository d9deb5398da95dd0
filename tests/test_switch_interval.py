"""An open engine lowers the interpreter's thread switch interval (its loop thread must get the
GIL promptly from threads that submit); the last engine closed puts back what it found. A
server's front end lowers it while it listens."""

from __future__ import annotations

import sys

import pytest

import pipepool
from pipepool.runtime import switch_interval


@pytest.fixture
def default_interval():
    saved = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield 0.005
    sys.setswitchinterval(saved)


def test_engines_lower_the_interval_until_the_last_one_closes(bert_path, default_interval):
    first = pipepool.Engine(str(bert_path))
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    second = pipepool.Engine(str(bert_path), switch_interval_ms=0.2)
    assert sys.getswitchinterval() == pytest.approx(0.0002)  # lowered further, never raised
    first.close()
    assert sys.getswitchinterval() == pytest.approx(0.0002)  # the second still runs
    second.close()
    assert sys.getswitchinterval() == pytest.approx(default_interval)
    second.close()  # closing twice restores nothing twice
    assert sys.getswitchinterval() == pytest.approx(default_interval)


def test_zero_leaves_the_interpreter_alone(bert_path, default_interval):
    with pipepool.Engine(str(bert_path), switch_interval_ms=0) as engine:
        assert sys.getswitchinterval() == pytest.approx(default_interval)
        assert engine.embed(["still embeds"]).shape[0] == 1


def test_a_setting_changed_meanwhile_is_not_overwritten(default_interval):
    assert switch_interval.lower(0.001)
    sys.setswitchinterval(0.002)  # the application's own choice, made while an engine ran
    switch_interval.restore()
    assert sys.getswitchinterval() == pytest.approx(0.002)


def test_out_of_range_is_refused():
    with pytest.raises(pipepool.InvalidInputError, match="switch_interval_ms"):
        pipepool.Engine(switch_interval_ms=-1)


def test_for_configs_takes_the_shortest_asked():
    assert switch_interval.for_configs([0.5, 0.25]) == pytest.approx(0.00025)
    assert switch_interval.for_configs([0, 0.5]) == pytest.approx(0.0005)
    assert switch_interval.for_configs([0, 0]) == 0.0


def test_a_front_end_lowers_the_interval_while_it_listens(default_interval):
    """A server's front end (the main one or an ``--api-server-count`` worker, both built by
    ``build_server``) lowers the interval once it listens and puts it back when it stops."""
    import asyncio
    import socket

    from pipepool.server.front import AsyncEngine
    from pipepool.server.logs import log_config
    from pipepool.server.models import ModelNames, ServedModel, ServedModels
    from pipepool.server.owner import EngineOwner
    from pipepool.server.settings import ServerSettings
    from pipepool.server.uvicorn_server import build_server

    # A model whose engine is never built: the front end alone, no engine to lower anything.
    never_built = AsyncEngine(EngineOwner(lambda: pytest.fail("not built")), max_queued=1)
    models = ServedModels([ServedModel(ModelNames(("m",)), never_built)])
    listening: list[float] = []
    started = asyncio.Event()

    def on_started() -> None:
        listening.append(sys.getswitchinterval())
        started.set()

    server = build_server(
        ServerSettings(port=0), models, log_config("warning", "text"), on_started=on_started,
        switch_interval_s=0.001,
    )  # fmt: skip

    async def serve_until_listening() -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            serving = asyncio.create_task(server.serve(sockets=[sock]))
            waiting = asyncio.create_task(started.wait())
            await asyncio.wait({serving, waiting}, return_when=asyncio.FIRST_COMPLETED)
            server.should_exit = True
            await serving
            waiting.cancel()

    asyncio.run(serve_until_listening())
    assert listening == [pytest.approx(0.001)]
    assert sys.getswitchinterval() == pytest.approx(default_interval)
