"""Starting worker actors with the right resources (the scheduler owns them)."""

from __future__ import annotations

from typing import Any

import ray

from raysched.config import ServeConfig


def worker_options(config: ServeConfig) -> dict:
    """One GPU per worker when the cluster has GPUs (or device: cuda), else one CPU; spread."""
    gpus = ray.cluster_resources().get("GPU", 0)
    use_gpu = config.device == "cuda" or (config.device == "auto" and gpus >= 1)
    return {"num_cpus": 1, "num_gpus": 1 if use_gpu else 0, "scheduling_strategy": "SPREAD",
            "max_restarts": 0, "max_task_retries": 0}


def spawn_worker(config: ServeConfig, index: int) -> Any:
    from actors.worker import Worker  # the data plane; imported lazily, in the worker's process

    return ray.remote(Worker).options(**worker_options(config)).remote(config, index)
