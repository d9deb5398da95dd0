"""torch.compile of a stage's layer bodies in a thread of its own, while the stage serves.

Compiling takes seconds at every start, even with inductor's cache warm (importing torch's
compiler stack alone is ~3 s on the GPU machine), and an engine is ready to embed without it:
the eager layer bodies compute the same function. So where the user left ``compile`` to the
engine, an in-process stage starts eager (and without CUDA graphs, whose capture must not run
while another thread allocates on the device), this thread compiles and warms up a copy of the
model's layer bodies on a side stream, and the stage installs them between two steps
(``StageRunner``), capturing CUDA graphs of the compiled pieces from then on.

Vectors computed before and after agree to the dtype's rounding (the GPU tests check both paths
against the fp32 reference); they are not bit-identical, as a step of another size is not.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..models.base import StageModel

if TYPE_CHECKING:
    from .runner import StageSpec


def compiled_layer_body(
    model: StageModel, warm_up: Callable[[StageModel], None], spec: StageSpec
) -> object | None:
    """The model's layer bodies compiled and warmed up on a copy of it (``warm_up(copy)``: one
    forward that triggers compilation), or None with a warning if compiling failed. The model
    itself is untouched: the caller installs the result (``use_layer_body``) when it may."""
    try:
        shadow = copy.copy(model)  # shares the weights; its own layer-body attribute
        shadow.set_compiled(True)
        warm_up(shadow)
        return shadow.layer_body()
    except Exception as exc:  # an inductor/triton problem must not take the engine down
        warnings.warn(
            f"torch.compile failed on stage {spec.index}, running eagerly: {exc}", stacklevel=2
        )
        return None


class BackgroundCompile:
    """``compiled_layer_body`` in a thread of its own, on a side stream of the stage's GPU."""

    def __init__(
        self, model: StageModel, warm_up: Callable[[StageModel], None], spec: StageSpec
    ) -> None:
        self._done = threading.Event()
        self._body: object | None = None
        threading.Thread(
            target=self._compile, args=(model, warm_up, spec), daemon=True,
            name=f"pipepool-compile-{spec.index}",
        ).start()  # fmt: skip

    def _compile(
        self, model: StageModel, warm_up: Callable[[StageModel], None], spec: StageSpec
    ) -> None:
        try:
            if spec.device.type != "cuda":
                self._body = compiled_layer_body(model, warm_up, spec)
                return
            with _on_side_stream(spec.device):
                self._body = compiled_layer_body(model, warm_up, spec)
                torch.cuda.current_stream().synchronize()
        finally:
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once compiling has ended (compiled or failed)."""
        return self._done.wait(timeout)

    def take(self) -> tuple[bool, object | None]:
        """(ended, the compiled layer body or None if compiling failed); never blocks."""
        if not self._done.is_set():
            return False, None
        return True, self._body


@contextlib.contextmanager
def _on_side_stream(device: torch.device):
    with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
        yield
