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

Several stages in one process (``pipeline_backend="inproc"``) compile one at a time, and none
installs its compiled bodies before every one has ended: torch's FX tracing state is global to
the process, so a thread that calls a compiled function while another thread traces fails
("Detected that you are using FX to symbolically trace a dynamo-optimized function"), which
killed such an engine in one GPU test run of two.
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
    from ..loading.stage_spec import StageSpec


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


_one_at_a_time = threading.Lock()  # one compile (one FX trace) at a time in this process
_unfinished = threading.Condition()  # guards _num_unfinished
_num_unfinished = 0  # background compiles of this process that have not ended


class BackgroundCompile:
    """``compiled_layer_body`` in a thread of its own, on a side stream of the stage's GPU."""

    def __init__(
        self, model: StageModel, warm_up: Callable[[StageModel], None], spec: StageSpec
    ) -> None:
        global _num_unfinished
        self._body: object | None = None
        with _unfinished:
            _num_unfinished += 1
        threading.Thread(
            target=self._compile, args=(model, warm_up, spec), daemon=True,
            name=f"pipepool-compile-{spec.index}",
        ).start()  # fmt: skip

    def _compile(
        self, model: StageModel, warm_up: Callable[[StageModel], None], spec: StageSpec
    ) -> None:
        global _num_unfinished
        try:
            with _one_at_a_time:
                if spec.device.type != "cuda":
                    self._body = compiled_layer_body(model, warm_up, spec)
                    return
                with _on_side_stream(spec.device):
                    self._body = compiled_layer_body(model, warm_up, spec)
                    torch.cuda.current_stream().synchronize()
        finally:
            with _unfinished:
                _num_unfinished -= 1
                _unfinished.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """True once compiling has ended (compiled or failed), here and in every other stage
        of this process."""
        with _unfinished:
            return _unfinished.wait_for(lambda: _num_unfinished == 0, timeout)

    def take(self) -> tuple[bool, object | None]:
        """(ended, the compiled layer body or None if compiling failed); never blocks. Not
        ended while another stage of this process still compiles (see the module's note)."""
        if _num_unfinished:  # this compile counts until it ends
            return False, None
        return True, self._body


@contextlib.contextmanager
def _on_side_stream(device: torch.device):
    with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
        yield
