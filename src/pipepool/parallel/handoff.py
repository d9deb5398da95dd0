"""One deployment plan per pipeline: made once, by the driver (rank 0), handed to every rank.

Every rank checks, before it loads any weight, that the plan it unpickled is the plan the
driver made: the driver publishes the plan's fingerprint (``Deployment.fingerprint``, computed
from its fields), each rank recomputes it from what it received and refuses to go on when the
two differ (different pipepool or torch versions, a model folder that differs between hosts).

Under torchrun every rank starts from the same command line. Each rank first takes its own
device (``cuda:LOCAL_RANK``, ``set_device`` before any other CUDA work) and reports its free
memory; rank 0 plans with the least of them, so the KV cache fits on every host.
"""

from __future__ import annotations

import pickle
import time

import torch

from ..config import EngineConfig
from ..errors import ModelLoadError, StageFailure
from ..loading.deployment import (
    Deployment,
    free_gpu_bytes,
    plan_deployment,
    resolve_device_kind,
)
from .rendezvous import TorchrunEnv, engine_store, torchrun_store

PLAN_KEY = "deployment"
FINGERPRINT_KEY = "deployment-fingerprint"
PLAN_ERROR_KEY = "deployment-error"
_WAIT_S = 600.0  # rank 0 may take minutes to read a large checkpoint's index
_POLL_S = 0.02


def publish(store, deployment: Deployment) -> None:
    """Driver side: the fingerprint first, so that whoever sees the plan sees it too."""
    store.set(FINGERPRINT_KEY, deployment.fingerprint().encode())
    store.set(PLAN_KEY, pickle.dumps(deployment))


def receive(store, rank: int) -> Deployment:
    """Stage side: the driver's plan, checked against the driver's fingerprint."""
    _wait_for(store, PLAN_KEY)
    expected = store.get(FINGERPRINT_KEY).decode()
    deployment = pickle.loads(store.get(PLAN_KEY))
    found = deployment.fingerprint()
    store.set(f"fingerprint/{rank}", found.encode())
    if found != expected:
        raise ModelLoadError(
            f"rank {rank} received a deployment plan whose digest {found[:16]} differs from the "
            f"driver's {expected[:16]}: the hosts run different pipepool/torch versions or see "
            "different model folders"
        )
    return deployment


def torchrun_deployment(config: EngineConfig, env: TorchrunEnv) -> Deployment:
    """The one plan of a torchrun job, as this rank gets it (rank 0 makes it)."""
    raw, rdv = torchrun_store(env)
    store = engine_store(raw, rdv)
    if resolve_device_kind(config.device) == "cuda":
        count = torch.cuda.device_count()
        if env.local_rank >= count:
            raise ModelLoadError(
                f"rank {env.rank} has LOCAL_RANK {env.local_rank} but its host sees {count} "
                "GPU(s); start at most that many processes per node (--nproc-per-node)"
            )
        torch.cuda.set_device(env.local_rank)  # before anything else touches CUDA
        store.set(f"free-bytes/{env.rank}", str(free_gpu_bytes()))
    else:
        store.set(f"free-bytes/{env.rank}", "0")
    if env.rank > 0:
        return receive(store, env.rank)
    try:
        free = [int(_get(store, f"free-bytes/{r}")) for r in range(env.world)]
        deployment = plan_deployment(config, local_placement=True, gpu_free_bytes=min(free) or None)
        if deployment.num_stages != env.world:
            raise StageFailure(
                f"torchrun started {env.world} ranks for pipeline_parallel_size="
                f"{deployment.num_stages}: start one process per stage"
            )
    except BaseException as exc:
        # The other ranks wait for a plan: tell them there will be none.
        store.set(PLAN_ERROR_KEY, f"{type(exc).__name__}: {exc}")
        raise
    publish(store, deployment)
    return deployment


def _get(store, key: str) -> bytes:
    _wait_for(store, key)
    return store.get(key)


def _wait_for(store, key: str) -> None:
    """Wait for ``key``, failing at once if the driver reported that it could not plan."""
    deadline = time.monotonic() + _WAIT_S
    while not store.check([key]):
        if store.check([PLAN_ERROR_KEY]):
            reason = store.get(PLAN_ERROR_KEY).decode()
            raise StageFailure(f"the driver (rank 0) could not plan the deployment: {reason}")
        if time.monotonic() > deadline:
            raise StageFailure(f"no deployment plan from the driver after {_WAIT_S:.0f} s")
        time.sleep(_POLL_S)
