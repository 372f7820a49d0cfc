"""Starting worker actors with the right resources (the scheduler owns them).

The scheduler never imports the data plane: the actor class it starts is `Worker` below, a
torch-free shell whose constructor imports `actors.worker` *inside the worker's process* and whose
methods hand each call to the real `actors.worker.Worker` (or, when the config has faults, to
the class `actors.faults.with_faults` derives from it: fault code stays out of the production
worker). Ray pickles this class by reference
(`raysched.workers.Worker`), so the scheduler's process loads neither torch nor model code, and
the actor keeps the class name `Worker` in Ray's actor table.

    handle = spawn_worker(config, index=0)
    info = await handle.info.remote()
"""

from __future__ import annotations

import importlib
from typing import Any

import ray

from raysched.config import ServeConfig
from raysched.messages import FaultPoint, StepPlan, StepResult, Usage, WorkerInfo

DATA_PLANE_WORKER = "actors.worker"  # the module that defines the real Worker (torch, the model)


class Worker:
    """The worker actor as the scheduler knows it: each method runs the data-plane method of the
    same name (see `actors.worker.Worker` for what they do). A test checks that the two classes
    have the same public methods."""

    def __init__(self, config: ServeConfig, index: int) -> None:
        self._impl = data_plane_class(config)(config, index)  # imported in the worker's process only

    def info(self) -> WorkerInfo:
        return self._impl.info()

    def usage(self) -> Usage:
        return self._impl.usage()

    def running_ids(self) -> list[str]:
        return self._impl.running_ids()

    def is_idle(self) -> bool:
        return self._impl.is_idle()

    def retract(self, request_id: str) -> Any:
        return self._impl.retract(request_id)

    def retract_pending(self, request_id: str, fault: FaultPoint | None = None) -> tuple[Any, int]:
        return self._impl.retract_pending(request_id, fault)

    def step(self, plan: StepPlan, *snapshots: Any) -> StepResult:
        return self._impl.step(plan, *snapshots)

    def take_parked(self, keys: list[tuple[str, str, int]]) -> Any:
        return self._impl.take_parked(keys)

    def discard_parked(self, keys: list[tuple[str, str, int]]) -> None:
        self._impl.discard_parked(keys)


def data_plane_class(config: ServeConfig) -> type:
    """The data-plane worker class for `config` (imports the data plane: call it in a worker)."""
    cls = importlib.import_module(DATA_PLANE_WORKER).Worker
    faults = importlib.import_module("actors.faults")
    return faults.with_faults(cls) if faults.needs_faults(config) else cls


def worker_options(config: ServeConfig) -> dict:
    """One GPU per worker when the cluster has GPUs (or device: cuda), else one CPU; spread."""
    gpus = ray.cluster_resources().get("GPU", 0)
    use_gpu = config.device == "cuda" or (config.device == "auto" and gpus >= 1)
    return {"num_cpus": 1, "num_gpus": 1 if use_gpu else 0, "scheduling_strategy": "SPREAD",
            "max_restarts": 0, "max_task_retries": 0, "enable_task_events": False}


def spawn_worker(config: ServeConfig, index: int) -> Any:
    """Start worker `index`; returns its actor handle (the caller owns the actor)."""
    return ray.remote(Worker).options(**worker_options(config)).remote(config, index)
