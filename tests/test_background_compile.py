"""Compiling in the background (stage/background_compile.py): where ``compile`` is left to the
engine on CUDA, an in-process stage serves eagerly while a thread compiles, and installs the
compiled layer bodies between two steps. On the CPU the same path runs with a stand-in for
torch.compile that holds "compiling" until the test lets it finish, so every step of the
hand-over is observable."""

from __future__ import annotations

import dataclasses
import threading
import warnings

import numpy as np
import pytest

import pipepool
import pipepool.driver.local
import pipepool.models.bert as bert
from pipepool.loading.deployment import plan_deployment

TEXTS = [f"text number {i} " + "word " * (i % 23) for i in range(40)]


class SlowCompile:
    """Stands in for ``compile_layer_fn``: the compiled body is the eager function, counted
    per thread; its first call (the compiling thread's warm-up) waits for ``release``."""

    def __init__(self, fail: bool = False) -> None:
        self.release = threading.Event()
        self.calls: dict[str, int] = {}
        self.fail = fail

    def __call__(self, fn, *, round_like_eager: bool):
        def compiled(*args, **kwargs):
            name = threading.current_thread().name
            if name.startswith("pipepool-compile") and not self.release.wait(30):
                raise TimeoutError("the test never released the compile")
            if self.fail:
                raise RuntimeError("inductor says no")
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return compiled


@pytest.fixture
def background(monkeypatch):
    """Engines of this test compile in the background, through a ``SlowCompile``."""

    def deployment_for(config):
        d = plan_deployment(config)
        return dataclasses.replace(d, compile=True, compile_in_background=True)

    def install(fail: bool = False) -> SlowCompile:
        slow = SlowCompile(fail)
        monkeypatch.setattr(bert, "compile_layer_fn", slow)
        monkeypatch.setattr(pipepool.driver.local, "deployment_for", deployment_for)
        return slow

    return install


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_engine_serves_while_compiling_then_installs_the_compiled_bodies(bert_path, background):
    with pipepool.Engine(str(bert_path), device="cpu", dtype="float32", compile=False) as eager:
        want = eager.embed(TEXTS)
    slow = background()
    with pipepool.Engine(str(bert_path), device="cpu", dtype="float32") as engine:
        before = engine.embed(TEXTS)  # ready, and answering, while the compile is held
        assert engine.pipeline.wait_until_compiled(timeout=0.05) is False
        assert slow.calls == {}  # nothing ran the compiled body yet
        slow.release.set()
        assert engine.pipeline.wait_until_compiled(timeout=30) is True
        after = engine.embed(TEXTS)
        assert slow.calls.get("pipepool-engine", 0) > 0, slow.calls  # the loop now runs it
        assert any(name.startswith("pipepool-compile") for name in slow.calls)  # warm-up
    assert _cosines(before, want).min() > 0.9999999
    assert _cosines(after, want).min() > 0.9999999


def test_a_failed_background_compile_leaves_the_engine_eager(bert_path, background):
    slow = background(fail=True)
    slow.release.set()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pipepool.Engine(str(bert_path), device="cpu", dtype="float32") as engine:
            assert engine.pipeline.wait_until_compiled(timeout=30) is True
            vectors = engine.embed(TEXTS)
    assert vectors.shape[0] == len(TEXTS) and np.isfinite(vectors).all()
    assert any("torch.compile failed" in str(w.message) for w in caught)
    assert slow.calls == {}


def test_compile_is_left_to_the_engine_only_in_process_on_cuda(bert_path):
    """The rule, in deployment.py: background only where ``compile`` was not given, on CUDA,
    with the stages in this process. On the CPU nothing compiles unless asked."""
    d = plan_deployment(pipepool.EngineConfig.from_options(model=str(bert_path), device="cpu"))
    assert not d.compile and not d.compile_in_background
    d = plan_deployment(
        pipepool.EngineConfig.from_options(model=str(bert_path), device="cpu", compile=True)
    )
    assert d.compile and not d.compile_in_background
