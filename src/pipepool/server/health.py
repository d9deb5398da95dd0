"""What ``/health`` and the per-model readiness route answer: each model's state and the state
of the server's other components (the batch store, ...), and the one status a load balancer
reads.

The rule: the server is healthy (200) while any model serves. ``status`` is ``ok`` when every
model serves and every component is ok, ``degraded`` (still 200) when some model or component
is not, and, when no model serves, the least healthy model's status (503). So one model
restarting in a server of several does not drain the others from a load balancer; its own
readiness (``/v2/models/NAME/ready``, ``/health?model=NAME``) says 503 meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pydantic import BaseModel

from .models import ServedModel

# A model's statuses, healthiest first: with none serving, the server reports its least healthy.
SEVERITY = ("ok", "loading", "degraded", "closed", "dead", "failed")
OK = "ok"
DEGRADED = "degraded"


class ModelHealth(BaseModel):
    """One model's health: ``ok`` (it serves), ``loading``, ``degraded`` (a stage or replica
    is restarting: its requests wait, and are answered once it is back), ``dead`` or
    ``failed`` (for good), ``closed`` (shutting down); with replicas, each one's state."""

    status: str
    replicas: list[str] | None = None


class ComponentState(BaseModel):
    """A component of the server other than the models (the batch store, ...): ``ok`` or
    ``degraded``, with why."""

    status: str
    detail: str | None = None


class HealthResponse(BaseModel):
    """``ok`` or ``degraded`` (200: some model serves), else the least healthy model's status
    (503). One model: its replicas here; several: each in ``models``. ``components``: those
    that are not ok."""

    status: str
    api_server: int | None = None  # which front-end process answered (--api-server-count > 1)
    replicas: list[str] | None = None  # each replica's state (--dp > 1), of a lone model
    models: dict[str, ModelHealth] | None = None  # each model's own, by the name it answers
    components: dict[str, ComponentState] | None = None  # those not ok, by name


class ReadyResponse(BaseModel):
    """KServe's (Open Inference Protocol's) model readiness: 200 ready, 503 not, with the
    model's status."""

    name: str
    ready: bool
    status: str


@dataclass(frozen=True)
class ComponentHealth:
    """What a component's check returns: ``ok`` or not, and why not."""

    ok: bool
    detail: str | None = None


class HealthChecks:
    """The server's components other than its models, each a named check ``/health`` and
    ``/metrics`` ask at every request (a check must be cheap and never raise)."""

    def __init__(self) -> None:
        self._checks: dict[str, Callable[[], ComponentHealth]] = {}

    def add(self, name: str, check: Callable[[], ComponentHealth]) -> None:
        assert name not in self._checks, f"two health checks named {name!r}"
        self._checks[name] = check

    def states(self) -> dict[str, ComponentHealth]:
        return {name: check() for name, check in self._checks.items()}


def model_health(model: ServedModel) -> ModelHealth:
    owner = model.front.owner
    engine = owner.engine
    if engine is None:
        status = "failed" if owner.error is not None else "loading"
    else:
        status = engine.health
    replicas = engine.pipeline.replica_status() if engine is not None else []
    return ModelHealth(status=status, replicas=[r.state for r in replicas] or None)


def server_health(
    models: Iterable[ServedModel], components: dict[str, ComponentHealth]
) -> tuple[int, HealthResponse]:
    """The HTTP status and body of ``/health`` for ``models`` and ``components`` (the rule of
    this module's docstring)."""
    each = {m.name: model_health(m) for m in models}
    statuses = [h.status for h in each.values()]
    failing = {
        name: ComponentState(status=DEGRADED, detail=c.detail)
        for name, c in components.items()
        if not c.ok
    }
    if OK not in statuses:
        status, code = max(statuses, key=SEVERITY.index), 503
    elif failing or any(s != OK for s in statuses):
        status, code = DEGRADED, 200
    else:
        status, code = OK, 200
    body = HealthResponse(status=status, components=failing or None)
    if len(each) == 1:
        body.replicas = next(iter(each.values())).replicas  # one model: its own body
    else:
        body.models = each
    return code, body


def model_ready(model: ServedModel, asked: str) -> tuple[int, ReadyResponse]:
    """One model's readiness (``asked``: the name the probe used): 200 while it serves."""
    status = model_health(model).status
    ready = status == OK
    name = model.names.response_name(asked)
    return (200 if ready else 503), ReadyResponse(name=name, ready=ready, status=status)
