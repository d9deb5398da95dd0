"""Choosing and starting the executor for a deployment."""

from __future__ import annotations

from collections.abc import Callable

from ..config import EngineConfig
from ..loading.deployment import Deployment, plan_deployment
from ..stage.runner import new_runner
from .executor import Executor, UniprocExecutor


def deployment_for(config: EngineConfig) -> Deployment:
    """The deployment plan this process runs: its own, or under torchrun the one rank 0 made
    for every rank (``handoff``)."""
    from .rendezvous import torchrun_env

    env = torchrun_env()
    if env is None:
        return plan_deployment(config)
    from .handoff import torchrun_deployment

    return torchrun_deployment(config, env)


def start_executor(
    deployment: Deployment,
    *,
    replacing: Executor | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> Executor:
    """The executor the deployment asks for. ``replacing``: a failed one whose stages are
    restarted (the driver's own stage is reused, its requests forgotten); ``cancelled()``
    aborts a start that waits for stage processes to load."""
    config = deployment.config
    if deployment.num_stages == 1 or config.pipeline_backend == "inproc":
        runners = [
            new_runner(deployment, deployment.stage_spec(k)) for k in range(deployment.num_stages)
        ]
        # Running ahead (CUDA): a second plan in flight lets the host build step k+1 while
        # the device runs step k.
        depth = 2 if deployment.overlap_steps else 1
        return UniprocExecutor(runners, depth=depth)
    from .multiproc import MultiprocExecutor, run_torchrun_worker
    from .rendezvous import torchrun_env

    env = torchrun_env()
    if env is not None and env.rank > 0:
        # Under torchrun every rank runs the same program; ranks > 0 serve as stages and
        # leave when the driver (rank 0) shuts the pipeline down.
        raise SystemExit(run_torchrun_worker(deployment))
    stage0 = None
    if isinstance(replacing, MultiprocExecutor):
        stage0 = replacing.runner
        stage0.forget_requests()
    return MultiprocExecutor.start(deployment, stage0=stage0, cancelled=cancelled)
